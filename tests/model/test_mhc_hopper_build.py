"""The two-launch mHC entry of a decode batch built for Hopper without a GPU (Triton's bundled
ptxas), at V4-Flash width on meta tensors: its settle-and-mix program sits at the register file's
edge (255 registers, two programs an SM), so a spill is the regression to catch, and the mixes
must run on the tensor cores."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from model.kernels.mhc import mhc
from tests.model.test_moe_hopper_build import hopper_compile, without_interpreter

# compiles kernels for Hopper on the CPU: a minute on 2 cores, so CI runs it and the fast tier does not
pytestmark = pytest.mark.slow

HC, D, MIX = 4, 4096, 24


class _Recorder:
    """Stands in for a kernel in `mhc`'s namespace: records each launch's arguments instead of
    running it, for `hopper_compile`."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.launches.append(SimpleNamespace(kernel=self.kernel, args=args, meta=meta, grid=grid))
        return launch


def batch_entry_launches(T: int, head: bool = False) -> list:
    """The launches of `mhc.sublayer_input` (or `head_input`) for T tokens with a pending hc_post,
    planned on meta tensors."""
    launches: list = []
    real = mhc._settle_mix_kernel, mhc._collapse_kernel
    mhc._settle_mix_kernel, mhc._collapse_kernel = (_Recorder(k, launches) for k in real)
    try:
        meta = dict(device="meta")
        res = mhc.Residual(torch.empty(T, HC, D, dtype=torch.bfloat16, **meta),
                           torch.empty(T, D, dtype=torch.bfloat16, **meta), torch.empty(T, HC, **meta),
                           torch.empty(T, HC, HC, **meta))
        w = torch.empty(D, **meta)
        if head:
            mhc.head_input(res, torch.empty(HC, HC * D, **meta), torch.empty(HC, **meta), torch.empty(1, **meta),
                           w, 1e-6, 1e-6, 1e-6, "triton")
        else:
            mhc.sublayer_input(res, torch.empty(MIX, HC * D, **meta), torch.empty(MIX, **meta),
                               torch.empty(3, **meta), w, 1e-6, HC, 20, 1e-6, 1e-6, "triton")
    finally:
        mhc._settle_mix_kernel, mhc._collapse_kernel = real
    return launches


def check_batch_entry_build(T: int, head: bool) -> None:
    launches = batch_entry_launches(T, head)
    assert [launch.kernel.__name__ for launch in launches] == ["_settle_mix_kernel", "_collapse_kernel"]
    for launch in launches:
        k, usage = hopper_compile(launch)
        assert " LOCAL:0 " in usage and " STACK:0 " in usage, (launch.kernel.__name__, launch.meta, usage)
        if launch.kernel.__name__ == "_settle_mix_kernel":  # 64-token blocks: wgmma, 16: mma.sync
            mma = "wgmma.mma_async" if launch.meta["BT"] >= 64 else "mma.sync"
            assert re.search(rf"{mma}\S*\.bf16", k.asm["ptx"]), (launch.meta, "mixes off the tensor cores")


@pytest.mark.parametrize("T, head", [(64, False), (8, False), (256, True)])
def test_batch_entry_compiles_for_hopper_without_spills(T, head):
    """Both launches of the default decode-batch entry (64- and 16-token programs, the head's
    entry) compiled for sm_90 in a process without the interpreter: no local-memory spills, and
    the mixes on the tensor cores."""
    without_interpreter(f"check_batch_entry_build({T}, {head})", module="tests.model.test_mhc_hopper_build")


def test_batch_entry_launches_follow_the_token_count():
    """From 3 to `BATCH_TOKENS` tokens the entry is the two launches, 16-token programs up to 16
    tokens and 64 above, a collapse program a token; the head's entry mixes its pre rows only."""
    for T, bt in ((3, 16), (16, 16), (17, 64), (mhc.BATCH_TOKENS, 64)):
        mix, collapse = batch_entry_launches(T)
        assert mix.meta["BT"] == bt and mix.grid == (-(-T // bt), D // mix.meta["CD"]), (T, mix.grid)
        assert collapse.grid == (T,) and collapse.meta["SPLIT"] == D // mix.meta["CD"]
        assert mix.meta["POST"] and not mix.meta["HEAD"] and not collapse.meta["HEAD"]
    mix, collapse = batch_entry_launches(8, head=True)
    assert mix.meta["HEAD"] and collapse.meta["HEAD"]
