"""The Gumbel-max draw's kernel against the torch reference: the same token for every row, bit-exact
noise included (interpreter on CPU, compiled on a GPU)."""

import pytest
import torch

from model.kernels.common import gumbel
from model.sampling import SamplingParams, sample_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(rows: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    scaled = torch.randn(rows, vocab, generator=g) * 3
    scaled[1:3, 100:140] = float(scaled.max()) + 1  # ties on top, cut inside them
    keys = torch.randint(0, 1 << 32, (rows, 3), generator=g)
    ranked, order = scaled.sort(dim=-1, descending=True, stable=True)
    last = torch.randint(0, 60, (rows,), generator=g)
    last[1] = 17  # the 18th of the 40 tied tokens: ids 100..117 kept
    last[2] = 0  # only the best: the lowest id among the ties, whatever the noise
    thr_value, thr_id = ranked.gather(1, last[:, None])[:, 0], order.gather(1, last[:, None])[:, 0]
    thr_value[0], thr_id[0] = float("-inf"), vocab  # row 0 keeps everything
    return [t.to(DEVICE) for t in (scaled, keys, thr_value, thr_id)]


@pytest.mark.parametrize("rows,vocab", [(6, 9000), (3, 4096), (3, 70)])
def test_gumbel_argmax_matches_reference(rows, vocab):
    scaled, keys, thr_value, thr_id = _case(rows, vocab, seed=rows * vocab)
    ref = gumbel.gumbel_argmax(scaled, keys, thr_value, thr_id, "torch")
    got = gumbel.gumbel_argmax(scaled, keys, thr_value, thr_id, "triton")
    assert got.tolist() == ref.tolist()
    assert gumbel.kept(scaled, thr_value, thr_id)[torch.arange(rows), got].all()
    if vocab > 100:
        assert 100 <= int(got[1]) <= 117 and int(got[2]) == 100
    else:
        assert int(got[2]) == int(scaled[2].argmax())
    # the noise decides: other keys draw other tokens from the same full-support row
    others = [int(gumbel.gumbel_argmax(scaled[:1], keys[:1] + i, thr_value[:1], thr_id[:1], "triton"))
              for i in range(1, 9)]
    assert len(set(others)) > 1


def test_sample_rows_is_the_same_with_either_draw():
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(8, 5000, generator=g) * 2).to(DEVICE)
    params = [SamplingParams(temperature=0.5 + 0.2 * i, top_k=(0, 30)[i % 2], top_p=(1.0, 0.9, 1.0, 0.5)[i % 4],
                             seed=i) for i in range(8)]
    positions = list(range(100, 108))
    assert sample_rows(logits, params, positions, "triton") == sample_rows(logits, params, positions, "torch")
