"""Sampling is a pure function of (logits, seed, position), batched or not."""

import random

import pytest
import torch

from model.kernels.common.gumbel import hash32, uniform_noise
from model.sampling import DrawInputs, SamplingParams, draw_rows, sample, sample_rows, support


def logits(seed=0, vocab=50):
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_argmax():
    x = logits()
    assert sample(x, SamplingParams(), 7) == int(x.argmax())


def test_pure_function_of_seed_and_position():
    x, p = logits(), SamplingParams(temperature=1.0, seed=42)
    first = [sample(x, p, pos) for pos in range(200)]
    assert first == [sample(x.clone(), p, pos) for pos in range(200)]  # no hidden state
    assert first != [sample(x, SamplingParams(temperature=1.0, seed=43), pos) for pos in range(200)]
    assert len(set(first)) > 5  # positions draw different noise


def test_frequencies_follow_softmax():
    x, p = logits(1, vocab=8), SamplingParams(temperature=0.7, seed=1)
    counts = torch.bincount(torch.tensor([sample(x, p, pos) for pos in range(6000)]), minlength=8).float()
    expected = (x / 0.7).softmax(-1) * 6000
    assert ((counts - expected).abs() <= 4 * expected.sqrt() + 5).all()


def test_top_k_and_top_p_restrict_support():
    x = logits(2)
    order = x.argsort(descending=True)
    picked = {sample(x, SamplingParams(temperature=5.0, top_k=3, seed=0), pos) for pos in range(300)}
    assert picked <= set(order[:3].tolist()) and len(picked) == 3
    probs = (x / 1.0).softmax(-1)[order]
    keep = int((probs.cumsum(-1) < 0.6).sum()) + 1
    rows = [SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=1.0, top_k=3, top_p=0.99),
            SamplingParams(temperature=1.0), SamplingParams()]
    spiked = x.clone()
    spiked[order[0]] = 60.0  # the tail's mass rounds away: cum - p reaches 1.0 in fp32
    kept = support(torch.stack([x, x, spiked, x]), rows)
    assert set(kept[0].nonzero().flatten().tolist()) == set(order[:keep].tolist())
    assert set(kept[1].nonzero().flatten().tolist()) <= set(order[:3].tolist())
    assert kept[2].all()  # top_p = 1 cuts nothing, whatever the rounding, in a batch with top_p rows
    assert kept[3].nonzero().flatten().tolist() == [int(x.argmax())]


def test_top_k_ties_keep_the_lowest_ids():
    x = torch.tensor([0.0, 2.0, 1.0, 2.0, 2.0, 2.0])
    assert support(x[None], [SamplingParams(temperature=1.0, top_k=2)])[0].nonzero().flatten().tolist() == [1, 3]
    picked = {sample(x, SamplingParams(temperature=1.0, top_k=2, seed=5), pos) for pos in range(100)}
    assert picked == {1, 3}


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_noise_hash_is_exact_32_bit_arithmetic():
    """The tensor hash must equal the integer one bit for bit: that is what makes the noise the
    same on every device (an int64 product that overflowed would not be)."""
    xs = [0, 1, 0xFFFF, 0x10000, 0xFFFFFFFF, 0x80000000] + random.Random(0).sample(range(1 << 32), 200)
    assert hash32(torch.tensor(xs)).tolist() == [_lowbias32(x) for x in xs]


def test_noise_is_uniform():
    u = uniform_noise(torch.tensor([[1, 2, 3], [7, 8, 9]]), torch.arange(50000).repeat(2, 1))
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert torch.histc(u.float(), bins=10, min=0, max=1).sub(10000).abs().max() < 400  # ~4 sigma
    assert abs(float(torch.corrcoef(u)[0, 1])) < 0.03  # different keys, unrelated noise


def test_noise_belongs_to_the_token_not_its_rank():
    """Logits that differ only in the order of near-equal values (as a CPU and a GPU forward may)
    draw the same tokens: each token's noise is keyed by its id."""
    x = 1.0 + 1e-7 * torch.arange(64.0)
    p = SamplingParams(temperature=1.0, seed=9)
    ups = [sample(x, p, pos) for pos in range(100)]
    assert ups == [sample(x.flip(0), p, pos) for pos in range(100)] and len(set(ups)) > 20


def test_a_row_samples_the_same_in_any_batch():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(12, 300, generator=gen) * 3
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=i)
              for i, (t, k, p) in enumerate([(0, 0, 1), (1.0, 0, 1), (0.7, 20, 1), (1.3, 0, 0.8)] * 3)]
    positions = list(range(40, 52))
    batched = sample_rows(x, params, positions)
    assert batched == [sample(x[i], p, pos) for i, (p, pos) in enumerate(zip(params, positions))]
    perm = torch.randperm(12, generator=gen).tolist()
    shuffled = sample_rows(x[perm], [params[i] for i in perm], [positions[i] for i in perm])
    assert shuffled == [batched[i] for i in perm]
    assert sample_rows(x[:1].bfloat16(), params[:1], positions[:1]) == [int(x[0].bfloat16().argmax())]


def test_draw_inputs_draw_what_draw_rows_draws():
    """A chain graph's draws (`DrawInputs`: parameters and keys loaded into static tensors) give
    `draw_rows`' tokens at every step, for greedy, temperature and min_p rows beside padding rows;
    rows with top-k, top-p or adjustments are refused."""
    gen = torch.Generator().manual_seed(4)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=3),
              SamplingParams(temperature=1.5, seed=8, min_p=0.1), SamplingParams(temperature=1.0, seed=8)]
    positions = [[40 + i + k for k in range(3)] for i in range(4)]
    draws = DrawInputs(6, 3, 500, torch.device("cpu"))
    draws.load(params, positions)
    for k in range(3):
        logits = torch.randn(6, 500, generator=gen) * 4
        got = draws.draw(logits, k, "torch")
        assert torch.equal(got[:4], draw_rows(logits[:4], params, [row[k] for row in positions], "torch"))
        assert torch.equal(got[4:], logits[4:].argmax(-1))  # padding rows: greedy
    for bad in (SamplingParams(1.0, top_k=5), SamplingParams(1.0, top_p=0.9),
                SamplingParams(1.0, logit_bias=((3, 1.0),))):
        assert not draws.capturable([bad])
        with pytest.raises(ValueError, match="top-k"):
            draws.load([bad], [[1, 2, 3]])


def test_draw_inputs_at_device_offsets_draw_at_the_offset_positions():
    """Loaded with candidate positions and per-row offsets on the device (a step queued before the
    host knows its rows' positions), row r's step k draws as `draw_rows` at candidate offset_r + k;
    a load without offsets afterwards draws at its own positions again, fewer rows than loaded
    draw as the first rows."""
    gen = torch.Generator().manual_seed(5)
    params = [SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=0),
              SamplingParams(temperature=1.2, seed=11, min_p=0.05)]
    candidates = [[100 + 7 * i + j for j in range(6)] for i in range(3)]
    offsets = [2, 0, 3]
    draws = DrawInputs(4, 3, 300, torch.device("cpu"), span=6)
    draws.load(params, candidates, torch.tensor(offsets))
    for k in range(3):
        logits = torch.randn(4, 300, generator=gen) * 3
        want = draw_rows(logits[:3], params, [row[o + k] for row, o in zip(candidates, offsets)], "torch")
        assert torch.equal(draws.draw(logits, k, "torch")[:3], want)
        assert torch.equal(draws.draw(logits[:2], k, "torch"), want[:2])
    draws.load(params, [row[:3] for row in candidates])
    logits = torch.randn(4, 300, generator=gen) * 3
    assert torch.equal(draws.draw(logits, 1, "torch")[:3],
                       draw_rows(logits[:3], params, [row[1] for row in candidates], "torch"))
    with pytest.raises(ValueError, match="6 positions each"):
        draws.load(params, [row[:3] for row in candidates], torch.tensor(offsets))
    with pytest.raises(ValueError, match="no offsets"):
        DrawInputs(4, 3, 300, torch.device("cpu")).load(params, [row[:3] for row in candidates], torch.tensor(offsets))


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2}])
def test_bad_parameters_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
