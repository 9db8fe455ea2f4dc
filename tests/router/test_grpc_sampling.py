"""Logprobs and the sampling controls through gRPC: the same request fields and checks as HTTP
(the stub's stand-in logprob values; tests/router/test_http_logprobs.py)."""

import grpc
import pytest

from router.grpc_server import request_body
from router.proto import v4serve_pb2 as pb, v4serve_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def stub(router):
    ch = grpc.insecure_channel(router.grpc_target)
    yield pb_grpc.InferenceStub(ch)
    ch.close()


def test_logprobs_ride_on_every_message(router, stub):
    out = list(stub.Generate(pb.GenerateRequest(prompt="abc", max_tokens=5, temperature=0.0, logprobs=3), timeout=10))
    ids = [t for m in out for t in m.token_ids]
    lps = [lp for m in out for lp in m.logprobs]
    assert [lp.token_id for lp in lps] == ids and len(ids) == 5
    assert all(lp.logprob == -0.5 and [t.logprob for t in lp.top] == [-0.5, -1.5, -2.5] for lp in lps)
    plain = list(stub.Generate(pb.GenerateRequest(prompt="abc", max_tokens=2, temperature=0.0), timeout=10))
    assert not any(m.logprobs for m in plain)


def test_sampling_controls_map_to_the_completions_body(stub):
    req = pb.GenerateRequest(prompt="x", presence_penalty=0.5, frequency_penalty=0.0, repetition_penalty=1.1,
                             logit_bias={5: -100.0}, min_tokens=2, logprobs=0)
    body = request_body(req)
    assert (body["presence_penalty"], body["frequency_penalty"], body["repetition_penalty"]) == (0.5, 0.0, 1.1)
    assert (body["logit_bias"], body["min_tokens"], body["logprobs"]) == ({"5": -100.0}, 2, 0)
    list(stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=3, **{k: v for k, v in body.items() if k not in (
        "prompt", "logit_bias")}, logit_bias={5: -100.0}), timeout=10))
    for bad in ({"presence_penalty": 3.0}, {"logit_bias": {5: 200.0}}, {"logprobs": 21}, {"min_tokens": 9}):
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=3, **bad), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
