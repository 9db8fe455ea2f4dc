"""The logit adjustments (model/penalties.py) through `sample_rows`: each changes the token it
should, with the values of its reference definition (transformers' processors for the repetition
penalty, OpenAI's formula for presence / frequency), row by row whatever the batch."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model.penalties import History, adjust
from model.sampling import SamplingParams, sample_rows

V = 64


def logits(seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_logit_bias_moves_the_greedy_token():
    x = logits(0)
    top = int(x.argmax())
    other = (top + 5) % V
    h = History((1, 2), ())
    assert sample_rows(x, [SamplingParams(logit_bias=((other, 100.0),))], [3], histories=[h]) == [other]
    assert sample_rows(x, [SamplingParams(logit_bias=((top, -100.0),))], [3], histories=[h]) != [top]
    got = adjust(x, [SamplingParams(logit_bias=((other, 2.5), (top, -1.0)))], [h])
    assert got[0, other] == x[0, other] + 2.5 and got[0, top] == x[0, top] - 1.0


def test_min_tokens_masks_the_stop_ids_until_reached():
    x = logits(1)
    eos = int(x.argmax())
    p = SamplingParams(min_tokens=2)
    assert sample_rows(x, [p], [9], histories=[History((1,), (4,), (eos,))]) != [eos]
    assert sample_rows(x, [p], [9], histories=[History((1,), (4, 5), (eos,))]) == [eos]
    assert sample_rows(x, [SamplingParams()], [9]) == [eos]


def test_repetition_penalty_is_transformers():
    x = logits(2)
    prompt, output = (3, 7, 7, 11), (20, 3, 41)
    got = adjust(x, [SamplingParams(repetition_penalty=1.3)], [History(prompt, output)])
    ref = transformers.RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), x.clone())
    assert torch.equal(got, ref)


def test_presence_and_frequency_penalties_are_openais_formula():
    x = logits(3)
    output = (5, 5, 5, 9, 12)
    got = adjust(x, [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)], [History((5, 30), output)])
    want = x.clone()
    for t, c in ((5, 3), (9, 1), (12, 1)):
        want[0, t] -= c * 0.25 + 0.5
    assert torch.allclose(got, want, atol=0, rtol=1e-6)
    assert got[0, 30] == x[0, 30]  # the prompt is not penalised by presence / frequency


def test_rows_are_adjusted_alone_and_a_missing_history_is_refused():
    x = logits(4, rows=3)
    params = [SamplingParams(temperature=0.7, seed=1, repetition_penalty=1.5, frequency_penalty=1.0),
              SamplingParams(), SamplingParams(logit_bias=((3, 7.0),), seed=2, temperature=1.0)]
    hs = [History((1, 2, 3), (4, 4)), None, History((9,), ())]
    batched = sample_rows(x, params, [5, 6, 7], histories=hs)
    alone = [sample_rows(x[i:i + 1], params[i:i + 1], [5 + i], histories=hs[i:i + 1])[0] for i in range(3)]
    assert batched == alone
    with pytest.raises(ValueError, match="without its history"):
        sample_rows(x[:1], params[:1], [5])


@pytest.mark.parametrize("bad", [{"presence_penalty": 2.5}, {"frequency_penalty": -3.0}, {"repetition_penalty": 0.0},
                                 {"logit_bias": ((1, 101.0),)}, {"logit_bias": tuple((i, 1.0) for i in range(301))},
                                 {"logit_bias": ((1, 1.0), (1, 2.0))}, {"min_tokens": -1}])
def test_out_of_range_values_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
