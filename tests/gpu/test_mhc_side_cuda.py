"""The mHC entry's post / comb kernel on a side stream (`mhc.EntryScratch`) gives the bits of the
same entries run in order: a chain of sub-blocks whose next entry reads the previous post and comb
after the join, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from model.kernels import arrival_counter
from model.kernels.mhc import mhc
from tests.model.kernel_cases import captured

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
HC, D, MIX = 4, 4096, 24


@pytest.mark.parametrize("T", [1, 2])
def test_entries_with_side_post_comb_match_in_order(T):
    g = torch.Generator(device="cuda").manual_seed(11 + T)
    layers = [(torch.randn(MIX, HC * D, device="cuda", generator=g) / (HC * D) ** 0.5,
               0.5 * torch.randn(MIX, device="cuda", generator=g), 0.5 + torch.rand(3, device="cuda", generator=g),
               1 + 0.1 * torch.randn(D, device="cuda", generator=g)) for _ in range(8)]
    x0 = torch.randn(T, HC, D, device="cuda", generator=g).bfloat16()
    arrivals = arrival_counter("cuda")

    def chain(scratch):
        res = mhc.Residual(x0)
        for fn, base, scale, w in layers:
            x, h, post, comb = mhc.sublayer_input(res, fn, base, scale, w, 1e-6, HC, 20, 1e-6, 1e-6, "triton",
                                                  arrivals, scratch=scratch)
            out = torch.tanh(h.float() * 3).bfloat16()  # the sub-block, on the main stream
            res = mhc.Residual(x, out, post, comb)
            if scratch is not None:
                scratch.join()
        return torch.cat([res.x.flatten().float(), res.post.flatten(), res.comb.flatten()])

    want = chain(None)
    scratch = mhc.EntryScratch.beside(mhc.mixes_buffer("cuda"))
    assert scratch.side is not None
    assert torch.equal(chain(scratch), want)
    graph, out = captured(lambda: chain(scratch))
    differ = 0
    for _ in range(50):
        graph.replay()
        differ += not torch.equal(out, want)
    assert differ == 0, f"{differ} of 50 replays differ"
