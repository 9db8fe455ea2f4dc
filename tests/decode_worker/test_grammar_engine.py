"""Grammar-constrained decoding in the decode engine, on the tiny random model and its byte
tokenizer: the output parses and validates against the JSON schema and ends with "stop"; the
tokens are the same when bounced between engines mid-decode (the grammar state rebuilt from the
output so far), with speculative decoding on (a grammar's rows accept no drafts), and in a retry
that recomputes the tokens so far as prompt; the first token sampled on the prefill side is
masked too. The HTTP / gRPC paths are
tests/router/test_structured_output.py."""

import dataclasses
import json
import random

import jsonschema
import pytest

from decode_worker.engine import DecodeConfig, DecodeEngine
from model.grammar import from_json_schema
from model.kv_pool import KVPools
from model.sampling import SamplingParams
from model.tiny import random_model, tiny_config
from model.tokenizer import ByteTokenizer
from prefill_worker.engine import PrefillEngine
from tests.decode_worker.test_decode_engine import run_all
from tests.decode_worker.test_migration_engine import move
from worker_runtime.wire import GenerateRequest, RequestState

SCHEMA = {"type": "object",
          "properties": {"s": {"type": "string", "maxLength": 2}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
                         "t": {"enum": [True, "bb"]}},
          "required": ["s", "n", "t"], "additionalProperties": False}
GRAMMAR = from_json_schema(SCHEMA)


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), with_mtp=True)


def engine(model, name="d0", spec=0) -> DecodeEngine:
    pools = KVPools(model.cfg, "fp32", max_tokens=512, max_seqs=4, with_mtp=bool(spec))
    return DecodeEngine(model, pools, ByteTokenizer(model.cfg.vocab_size), name, DecodeConfig(speculative_tokens=spec))


def requests() -> list[GenerateRequest]:
    """Three with the grammar (greedy and drawn) and one without."""
    rng = random.Random(3)
    return [GenerateRequest(f"g{i}", tuple(rng.randrange(256) for _ in range(5 + 7 * i)), max_tokens=30,
                            sampling=SamplingParams(temperature=0.9 * (i % 2), seed=i), grammar=GRAMMAR)
            for i in range(3)] + [GenerateRequest("free", (1, 2, 3), max_tokens=12, ignore_eos=True)]


ARRIVALS = [0, 1, 1, 0]


@pytest.fixture(scope="module")
def batched(model) -> dict[str, list[int]]:
    return run_all(engine(model), requests(), ARRIVALS)


def text_of(model, tokens: list[int]) -> str:
    """The JSON text: the request ended where its grammar did (at its last '}', which allows nothing more)."""
    assert model.cfg.eos_token_id not in tokens
    return ByteTokenizer(model.cfg.vocab_size).decode(tokens)


def test_output_validates_and_is_the_same_batched_and_bounced(model, batched):
    reqs = requests()
    for r in reqs[:3]:
        jsonschema.validate(json.loads(text_of(model, batched[r.request_id])), SCHEMA)
    # bounced between two engines after every step: the receiving one replays the output so far
    r = reqs[1]
    engines, at, out, moves = [engine(model, "a"), engine(model, "b")], 0, [], 0
    engines[0].submit(r)
    for _ in range(4 * r.max_tokens):  # a step yields a token (the first one after the prompt)
        chunks = engines[at].step()
        assert all(c.error is None for c in chunks), chunks
        out += [t for c in chunks for t in c.token_ids]
        if any(c.finish_reason for c in chunks):
            break
        if engines[at].running[r.request_id].state is RequestState.DECODING:
            out += [t for c in move(engines[at], engines[1 - at], r.request_id) for t in c.token_ids]
            at, moves = 1 - at, moves + 1
    else:
        pytest.fail("the bounced request did not finish")
    assert out == batched[r.request_id] and moves > 10


def test_speculation_with_a_grammar_is_exact(model, batched):
    """Grammar rows beside an unconstrained one in speculative steps: every row's tokens are those
    without speculation, the unconstrained row still drafts, and every segment has the verify
    graphs' N+1 rows."""
    spec = engine(model, spec=2)
    lengths, plan = set(), spec.plan

    def recording():
        planned = plan()
        if planned is not None:
            lengths.update(seg.length for seg, p in zip(planned.batch.segments, planned.pending) if p is not None)
        return planned

    spec.plan = recording
    assert run_all(spec, requests(), ARRIVALS) == batched
    assert spec.spec_proposed > 0
    assert lengths == {3}  # grammar rows too verify N+1 rows (placeholders, never accepted): the graphs' shape
    assert spec.pools.num_free() == spec.pools.idle_free()


def test_first_token_on_the_prefill_side_is_masked(model, batched):
    """A prefill engine samples a request's first token under its grammar (a JSON object opens
    with '{'), and the decode engine that admits it replays it and goes on to the same tokens
    as a local prefill."""
    req = requests()[1]
    pools = KVPools(model.cfg, "fp32", max_tokens=512, max_seqs=2)
    pe = PrefillEngine(model, pools, "p0", tokenizer=ByteTokenizer(model.cfg.vocab_size))
    pe.submit(req)
    (done,) = pe.step()
    assert done.first_token == ord("{")
    local = batched[req.request_id]
    assert local[0] == done.first_token
    d = engine(model)
    pages = {k: v for k, v in pools.resume_pages(done.seq).items() if v}
    got = {k: d.pools.alloc(k, len(v)) for k, v in pages.items()}
    for kind, ids in pages.items():
        d.pools.buffers[kind][got[kind]] = pools.buffers[kind][ids]
    seq = d.pools.adopt(done.seq.num_tokens, got)
    pe.release(done)
    out = [c.token_ids for c in d.admit_transferred(req, seq, done.first_token)]
    while req.request_id in d.running:
        out += [c.token_ids for c in d.step()]
    assert [t for ids in out for t in ids] == local


def test_a_recomputed_retry_replays_the_output_into_its_grammar(model, batched):
    """What the router sends after losing a decode worker: the tokens so far end the prompt, and
    `grammar_replay` puts the grammar where they left it; the rest is the tokens it would have had."""
    req, k = requests()[1], 6
    tokens = batched[req.request_id]
    retry = dataclasses.replace(req, request_id="retry", prompt_ids=req.prompt_ids + tuple(tokens[:k]),
                                max_tokens=req.max_tokens - k, grammar_replay=tuple(tokens[:k]))
    assert run_all(engine(model), [retry], arrivals=[0])["retry"] == tokens[k:]
