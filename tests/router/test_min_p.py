"""min_p (vLLM's semantics): the sampler's support keeps the tokens whose probability after
temperature is at least min_p × the top token's, before top-k and top-p; it stays a pure,
batch-invariant function of the row. Both endpoints and gRPC carry it into SamplingParams; out of
[0, 1] it is a 400 (tests/router/test_http_errors.py). Through the workers:
tests/router/test_echo_in_process.py."""

import math

import pytest
import torch

from model.sampling import SamplingParams, sample_rows, support
from router.generation_defaults import GenerationDefaults
from router.grpc_server import request_body
from router.openai_protocol import Limits, finalize, parse_chat, parse_completion
from router.proto import v4serve_pb2 as pb


def test_support_keeps_tokens_within_min_p_of_the_top_one():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)) * 3
    for min_p, temperature in [(0.05, 1.0), (0.3, 0.7), (0.9, 1.5), (1.0, 1.0)]:
        p = torch.softmax(logits / temperature, -1)
        want = p >= min_p * p.amax(-1, keepdim=True)
        got = support(logits, [SamplingParams(temperature, min_p=min_p)] * 6)
        # exact but at the threshold, where fp32 rounding may go either way
        near = ((logits / temperature - logits.amax(-1, keepdim=True) / temperature) - math.log(min_p)).abs() < 1e-5
        assert ((got == want) | near).all(), min_p
        assert got.sum() < want.numel() and (got.sum(-1) >= 1).all()
    assert support(logits, [SamplingParams(1.0, min_p=1.0)] * 6).sum(-1).tolist() == [1] * 6


def test_min_p_applies_before_top_k_and_top_p():
    """vLLM's order: top-p's mass is that of the tokens min_p left."""
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.06, 0.04]]))
    # min_p 0.4 keeps 0.4, 0.3, 0.2 (≥ 0.16), renormalized 0.44, 0.33, 0.22: top_p 0.75 then keeps two;
    # over the whole distribution top_p 0.75 needs three (0.4 + 0.3 < 0.75)
    assert support(logits, [SamplingParams(1.0, min_p=0.4, top_p=0.75)]).tolist() == [[True, True, False, False, False]]
    assert support(logits, [SamplingParams(1.0, top_p=0.75)]).sum().item() == 3
    assert support(logits, [SamplingParams(1.0, min_p=0.4, top_k=2)]).sum().item() == 2
    assert support(logits, [SamplingParams(1.0, min_p=0.4, top_k=4)]).sum().item() == 3


def test_min_p_draws_alone_what_it_draws_batched():
    logits = torch.randn(5, 200, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(1.0, seed=s, min_p=0.2 * (s % 3)) for s in range(5)]
    batched = sample_rows(logits, params, list(range(5)))
    assert batched == [sample_rows(logits[i:i + 1], [params[i]], [i])[0] for i in range(5)]
    assert sample_rows(logits, [SamplingParams(1.0, seed=9, min_p=1.0)] * 5, [0] * 5) == logits.argmax(-1).tolist()
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(1.0, min_p=1.01)


LIMITS = Limits(model_names=("m",), vocab_size=320, max_model_len=256, max_prompt_tokens=256, max_tokens_limit=64,
                default_max_tokens=16, max_stop_strings=4, max_stop_string_chars=20, max_stop_token_ids=4,
                defaults=GenerationDefaults(), default_seed=1, timeout_s=None)


def test_both_endpoints_and_grpc_carry_min_p():
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}], "min_p": 0.25, "temperature": 1}, LIMITS)
    completion = parse_completion({"prompt": [1, 2], "min_p": 0.5, "temperature": 1}, LIMITS)
    assert chat.sampling.min_p == 0.25 and completion.sampling.min_p == 0.5
    assert finalize(completion, [(1, 2)], LIMITS, 0.0).generate.sampling.min_p == 0.5
    assert parse_completion({"prompt": [1, 2]}, LIMITS).sampling.min_p == 0
    assert request_body(pb.GenerateRequest(prompt_token_ids=[1, 2], min_p=0.5))["min_p"] == 0.5
    assert "min_p" not in request_body(pb.GenerateRequest(prompt_token_ids=[1, 2]))
