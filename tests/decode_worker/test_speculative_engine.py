"""The decode engine's speculative steps give exactly the tokens of plain `generate`: batched with
local prefill chunks and other requests, after a prefill engine's pages (the MTP layer's among
them) are copied in as kvtransfer would, and bounced between engines mid-decode. The whole
process path (router → prefill worker → kvtransfer → decode worker) is in
tests/worker_runtime/test_in_process_speculation.py."""

import random

import pytest
import torch

from decode_worker.engine import DecodeConfig, DecodeEngine
from model.generate import generate
from model.kv_pool import KVPools, SeqKV
from model.sampling import SamplingParams
from model.tiny import random_model, tiny_config
from model.tokenizer import ByteTokenizer
from model.transformer import Transformer
from prefill_worker.engine import PrefillEngine
from prefill_worker.prefix_store import PrefixStore
from tests.decode_worker.test_decode_engine import run_all
from tests.decode_worker.test_migration_engine import move
from tests.model.test_speculation_fitted import PERIOD, fitted_model
from worker_runtime.wire import GenerateRequest, RequestState


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), with_mtp=True)


def reference(model, req: GenerateRequest) -> list[int]:
    pools = KVPools(model.cfg, "fp32", max_tokens=len(req.prompt_ids) + req.max_tokens, max_seqs=1)
    stop = frozenset() if req.ignore_eos else frozenset({model.cfg.eos_token_id})
    return generate(model, pools, list(req.prompt_ids), req.max_tokens, req.sampling, stop_ids=stop).token_ids


def engine(model, n: int, name: str = "d0", budget: int = 64) -> DecodeEngine:
    pools = KVPools(model.cfg, "fp32", max_tokens=512, max_seqs=4, with_mtp=True)
    return DecodeEngine(model, pools, ByteTokenizer(model.cfg.vocab_size), name,
                        DecodeConfig(prefill_token_budget=budget, speculative_tokens=n))


def requests(seed: int, lengths: list[int], max_tokens: int = 10) -> list[GenerateRequest]:
    rng = random.Random(seed)
    return [GenerateRequest(f"s{i}", tuple(rng.randrange(256) for _ in range(n)), max_tokens=max_tokens - i % 3,
                            ignore_eos=True, sampling=SamplingParams(temperature=0.8 * (i % 2), seed=i))
            for i, n in enumerate(lengths)]


def test_batched_speculative_decoding_gives_the_tokens_of_generate(model):
    """Requests arriving at different steps, prefilled locally in 64-token chunks beside the
    others' verify segments, greedy and at temperature 0.8; more requests than pool slots."""
    reqs = requests(0, [3, 70, 130, 21, 9])
    e = engine(model, 2)
    got = run_all(e, reqs, arrivals=[0, 0, 2, 5, 6])
    for r in reqs:
        assert got[r.request_id] == reference(model, r), r.request_id
    assert e.spec_proposed > 0 and 0 <= e.spec_accepted <= e.spec_proposed
    assert e.pools.num_free() == e.pools.idle_free()


def test_every_verify_segment_is_full_length_up_to_the_last_step(model):
    """With N drafts a request verifies N+1 tokens at every step up to its last, also where fewer
    than N tokens remain to its max_tokens (its pages hold N positions past it): a batch of
    decoding requests always has the verify graphs' shape. Tokens stay generate's (the rows past
    max_tokens are dropped) and every page comes back."""
    reqs = requests(1, [40, 12, 77], max_tokens=9)  # max_tokens 9, 8, 7: they end at different steps
    e = engine(model, 2)
    for r in reqs:
        e.submit(r)
    got, lengths, on_device = {r.request_id: [] for r in reqs}, set(), set()
    while e.has_work():
        planned = e.plan()
        if planned is None:
            continue
        lengths |= {seg.length for seg, p in zip(planned.batch.segments, planned.pending) if p is not None}
        # a step of decoding rows alone drafts on the device; one beside a prompt chunk on the host
        on_device |= {p.chain is not None for p in planned.pending if p is not None}
        for chunk in e.run(planned):
            got[chunk.request_id] += chunk.token_ids
    assert lengths == {3} and on_device == {True, False}
    for r in reqs:
        assert got[r.request_id] == reference(model, r), r.request_id
    assert e.pools.num_free() == e.pools.idle_free()


def test_speculation_stops_above_its_batch_limit(model):
    """With speculative_max_batch 2, a step of three or four decoding requests is a plain step and
    one of one or two drafts; the tokens are generate's either way, one step at a time and with
    the plain steps overlapped."""
    rng = random.Random(4)
    reqs = [GenerateRequest(f"b{i}", tuple(rng.randrange(256) for _ in range(20 + 9 * i)), max_tokens=13 - 3 * i,
                            ignore_eos=True, sampling=SamplingParams(temperature=0.8 * (i % 2), seed=i))
            for i in range(4)]
    want = {r.request_id: reference(model, r) for r in reqs}

    def limited(overlap: bool) -> DecodeEngine:
        pools = KVPools(model.cfg, "fp32", max_tokens=512, max_seqs=4, with_mtp=True)
        return DecodeEngine(model, pools, ByteTokenizer(model.cfg.vocab_size), "d",
                            DecodeConfig(prefill_token_budget=256, speculative_tokens=2, speculative_max_batch=2,
                                         overlap=overlap))

    e = limited(overlap=False)
    for r in reqs:
        e.submit(r)
    got, steps = {r.request_id: [] for r in reqs}, set()
    while e.has_work():
        planned = e.plan()
        if planned is None:
            continue
        if all(r.state is RequestState.DECODING for r, _ in planned.owners):
            steps.add((len(planned.owners), any(planned.pending)))
        for chunk in e.run(planned):
            got[chunk.request_id] += chunk.token_ids
    assert steps == {(4, False), (3, False), (2, True), (1, True)}
    assert got == want
    overlapped = limited(overlap=True)
    assert run_all(overlapped, reqs, arrivals=[0] * 4) == want
    assert overlapped.pools.num_free() == overlapped.pools.idle_free()


def prefilled(model, pools: KVPools, req: GenerateRequest) -> tuple[SeqKV, int]:
    """The prompt run by a prefill engine (MTP layer included) and its pages copied into `pools` as
    a transfer would: → (the request's KV there, the first token)."""
    src = KVPools(model.cfg, "fp32", max_tokens=512, max_seqs=2, with_mtp=True)
    pe = PrefillEngine(model, src, "p0")
    pe.submit(req)
    done = []
    while not done:
        done = pe.step()
    pages = {k: v for k, v in src.resume_pages(done[0].seq).items() if v}
    assert "state_mtp" in pages  # the main streams the MTP layer's next position pairs with
    got = {k: pools.alloc(k, len(v)) for k, v in pages.items()}
    for kind, ids in pages.items():
        pools.buffers[kind][got[kind]] = src.buffers[kind][ids]
    pe.release(done[0])
    assert src.num_free() == src.idle_free()
    return pools.adopt(done[0].seq.num_tokens, got), done[0].first_token


@pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.exhaustive), 3])
def test_prefilled_elsewhere_then_decoded_speculatively_and_migrated(model, n):
    """P/D: the prefill engine's pages (the MTP layer's KV computed by its forwards) drive the
    drafts; half-way each request moves to a second engine (pause, resume pages, adopt)."""
    reqs = requests(1, [40, 150], max_tokens=12)
    engines = [engine(model, n, "d0"), engine(model, n, "d1")]
    out = {r.request_id: [] for r in reqs}
    for r in reqs:
        seq, first = prefilled(model, engines[0].pools, r)
        for chunk in engines[0].admit_transferred(r, seq, first):
            out[r.request_id].extend(chunk.token_ids)
    for step in range(40):
        if step == 2:
            for r in reqs:
                if r.request_id in engines[0].decoding():
                    for chunk in move(engines[0], engines[1], r.request_id):
                        out[chunk.request_id].extend(chunk.token_ids)
        for e in engines:
            for chunk in e.step():
                out[chunk.request_id].extend(chunk.token_ids)
        if all(e.idle() for e in engines):
            break
    for r in reqs:
        assert out[r.request_id] == reference(model, r), r.request_id
    assert sum(e.spec_proposed for e in engines) > 0
    for e in engines:
        assert e.pools.num_free() == e.pools.idle_free()


def test_speculation_refuses_a_model_without_mtp_and_more_than_three_drafts(model):
    pools = KVPools(model.cfg, "fp32", max_tokens=128, max_seqs=2, with_mtp=True)
    with pytest.raises(ValueError, match="MTP block"):
        DecodeEngine(Transformer(model.cfg), pools, ByteTokenizer(320), "d", DecodeConfig(speculative_tokens=1))
    with pytest.raises(ValueError, match="0..3"):
        DecodeConfig(speculative_tokens=4)


def test_runs_accepted_whole_end_at_max_tokens_and_stop_tokens_inside_them():
    """The fitted model (tests/model/test_speculation_fitted.py) accepts most drafts: requests end
    at max_tokens and at a stop token falling inside an accepted run, with the tokens of generate,
    and the engine counts the drafts."""
    rng = random.Random(5)
    pattern = rng.sample(range(256), PERIOD)
    model = fitted_model(pattern * 8)
    stop = pattern[7]
    reqs = [GenerateRequest("len", tuple(pattern * 2), max_tokens=9, ignore_eos=True),
            GenerateRequest("stop", tuple(pattern * 2 + pattern[:3]), max_tokens=20, stop_token_ids=(stop,),
                            sampling=SamplingParams(temperature=0.8, seed=1)),
            GenerateRequest("long", tuple(pattern * 3 + pattern[:1]), max_tokens=14, ignore_eos=True)]
    e = engine(model, 3)
    got = run_all(e, reqs, arrivals=[0, 0, 1])
    for r in reqs:
        pools = KVPools(model.cfg, "fp32", max_tokens=128, max_seqs=1)
        want = generate(model, pools, list(r.prompt_ids), r.max_tokens, r.sampling,
                        stop_ids=frozenset(r.stop_token_ids)).token_ids
        assert got[r.request_id] == want, r.request_id
    assert got["stop"][-1] == stop and len(got["stop"]) == 5
    assert e.spec_accepted / e.spec_proposed > 0.8, (e.spec_accepted, e.spec_proposed)
    assert e.pools.num_free() == e.pools.idle_free()


def test_a_prefix_cache_hit_gives_the_mtp_layer_of_a_full_prefill(model):
    """A prompt resumed from a cached prefix at a page boundary b: its first computed chunk pairs
    the streams at b-1, restored with the compress state from the snapshot, with token b; the MTP
    layer's window then holds the bytes a prefill without the cache writes."""
    rng = random.Random(7)
    shared = [rng.randrange(256) for _ in range(130)]
    a, b = shared + [1, 2, 3], shared + [rng.randrange(256) for _ in range(8)]
    pools = KVPools(model.cfg, "fp32", page_size=128, max_tokens=512, max_seqs=4, with_mtp=True)
    pe = PrefillEngine(model, pools, "p0", store=PrefixStore(pools, "p0"))
    fresh_pools = KVPools(model.cfg, "fp32", page_size=128, max_tokens=512, max_seqs=4, with_mtp=True)
    fresh = PrefillEngine(model, fresh_pools, "p1")
    done = {}
    for engine_, name, prompt in ((pe, "a", a), (pe, "b", b), (fresh, "f", b)):
        engine_.submit(GenerateRequest(name, tuple(prompt), max_tokens=4))
        while name not in done:
            for d in engine_.step():
                done[d.request_id] = d
        if name == "a":
            pe.release(done["a"])  # into the cache
    assert done["b"].computed_tokens == len(b) - 128  # resumed at the page boundary
    window = torch.arange(len(b) - 1 - model.cfg.sliding_window, len(b) - 1)  # MTP positions, 127 among them
    layer = pools.mtp_layer
    assert torch.equal(pools.read("swa", layer, done["b"].seq.pages["swa"], window),
                       fresh_pools.read("swa", layer, done["f"].seq.pages["swa"], window))
    assert done["b"].first_token == done["f"].first_token
