"""Speculative decoding on a GPU replica (device format, Triton kernels, fp8_pack pools), as
`v4serve up --device cuda --speculative-tokens N` builds it. A verify step's segments of N+1
tokens go through the kernels eagerly as prefill chunks do, or replay a decode graph of N+1 tokens
a request. Without batch-invariant kernels (docs/gpu.md) a verify row's logits may differ in the
last bits from a single step's, so tokens are compared with plain decoding up to a near-tie, not
bit for bit."""

import dataclasses

import pytest
import torch

from decode_worker.engine import DecodeConfig, DecodeEngine
from model.generate import generate
from model.kv_pool import KVPools
from model.sampling import SamplingParams
from model.tokenizer import ByteTokenizer
from worker_runtime.model_loader import DecodeGraphs, load_replica
from worker_runtime.options import WorkerOptions
from worker_runtime.wire import GenerateRequest

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NEW = 24


def agree_up_to_a_near_tie(got: list[int], want: list[int], logits: torch.Tensor) -> bool:
    """Equal, or equal up to a token where plain decoding's top two logits were within 1% of the
    logits' spread (a choice the last bits of a product can flip)."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            row = logits[i].float()
            top = row.topk(2).values
            return float(top[0] - top[1]) <= 0.01 * float(row.max() - row.min())
    return len(got) == len(want)


@pytest.mark.parametrize("n", [1, 3])
def test_speculative_generate_on_the_gpu_agrees_with_plain_decoding(tiny_official_ckpt, n):
    options = WorkerOptions(str(tiny_official_ckpt), "", kv_dtype="fp8_pack", max_tokens=512, max_seqs=2,
                            device="cuda", kernels="triton", speculative_tokens=n)
    cfg, model, pools = load_replica(options)
    assert model.mtp and pools.with_mtp
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (150,), generator=g).tolist()
    plain_pools = KVPools(cfg, "fp8_pack", max_tokens=512, max_seqs=1, device="cuda", with_mtp=True)
    plain = generate(model, plain_pools, prompt, NEW, SamplingParams(), keep_logits=True)
    got = generate(model, pools, prompt, NEW, SamplingParams(), speculative_tokens=n)
    assert agree_up_to_a_near_tie(got.token_ids, plain.token_ids, plain.logits)
    assert got.proposed > 0


def test_speculative_decode_engine_on_the_gpu_returns_every_page(tiny_official_ckpt):
    options = WorkerOptions(str(tiny_official_ckpt), "", kv_dtype="fp8_pack", max_tokens=512, max_seqs=4,
                            device="cuda", kernels="triton", speculative_tokens=2)
    cfg, model, pools = load_replica(options)
    engine = DecodeEngine(model, pools, ByteTokenizer(cfg.vocab_size), "d",
                          DecodeConfig(max_running=4, speculative_tokens=2))
    g = torch.Generator().manual_seed(0)
    requests = [GenerateRequest(f"r{i}", tuple(torch.randint(0, 256, (k,), generator=g).tolist()), max_tokens=NEW,
                                ignore_eos=True, sampling=SamplingParams(temperature=0.8 * (i % 2), seed=i))
                for i, k in enumerate((150, 37, 90))]
    for r in requests:
        engine.submit(r)
    tokens = {r.request_id: [] for r in requests}
    while engine.has_work():
        for chunk in engine.step():
            assert chunk.error is None, chunk.error
            tokens[chunk.request_id] += chunk.token_ids
    assert all(len(t) == NEW for t in tokens.values())
    assert engine.spec_proposed > 0
    assert pools.num_free() == pools.idle_free()
    # the same requests without speculation: equal up to near-ties (no batch invariance on the GPU)
    _, _, plain_pools = load_replica(dataclasses.replace(options, speculative_tokens=0))
    plain = DecodeEngine(model, plain_pools, ByteTokenizer(cfg.vocab_size), "p", DecodeConfig(max_running=4))
    for r in requests:
        plain.submit(r)
    want = {r.request_id: [] for r in requests}
    while plain.has_work():
        for chunk in plain.step():
            want[chunk.request_id] += chunk.token_ids
    assert all(tokens[r][0] == want[r][0] for r in tokens)  # first tokens: the same prefill step


@pytest.mark.parametrize("limit", [4, 2])
def test_verify_steps_replay_cuda_graphs(tiny_official_ckpt, limit):
    """Decode graphs captured as verify steps of N+1 = 3 tokens a request: every step whose
    requests all verify two drafts replays one (the MTP extension inside), the others
    run eagerly; every request gets its tokens, pages come back (the scratch request stays held),
    and the tokens match an eager speculative replica up to near-ties. With a batch limit of 2 the
    bucket of 4 is a plain step, which the three requests' first steps replay."""
    options = WorkerOptions(str(tiny_official_ckpt), "", kv_dtype="fp8_pack", max_tokens=512, max_seqs=4,
                            device="cuda", kernels="triton", speculative_tokens=2, decode_graphs=(1, 2, 4),
                            speculative_max_batch=limit)
    cfg, model, pools = load_replica(options)
    graphs = DecodeGraphs(model, pools, options.decode_graphs, options.max_tokens, tokens_per_row=3,
                          verify_max_rows=limit)
    assert [(g.B, g.L) for g in graphs.graphs] == [(1, 3), (2, 3), (4, 3 if limit == 4 else 1)]
    config = DecodeConfig(max_running=4, speculative_tokens=2, speculative_max_batch=limit)
    engine = DecodeEngine(model, pools, ByteTokenizer(cfg.vocab_size), "d", config, graphs)
    g = torch.Generator().manual_seed(2)
    requests = [GenerateRequest(f"r{i}", tuple(torch.randint(0, 256, (k,), generator=g).tolist()), max_tokens=NEW,
                                ignore_eos=True) for i, k in enumerate((150, 37, 90))]
    for r in requests:
        engine.submit(r)
    tokens = {r.request_id: [] for r in requests}
    while engine.has_work():
        for chunk in engine.step():
            assert chunk.error is None, chunk.error
            tokens[chunk.request_id] += chunk.token_ids
    assert all(len(t) == NEW for t in tokens.values())
    assert graphs.replays > 0
    assert pools.num_free() == engine.idle_free() and engine.idle_free() != pools.idle_free()
    _, _, eager_pools = load_replica(dataclasses.replace(options, decode_graphs=()))
    eager = DecodeEngine(model, eager_pools, ByteTokenizer(cfg.vocab_size), "e", config)
    for r in requests:
        eager.submit(r)
    want = {r.request_id: [] for r in requests}
    while eager.has_work():
        for chunk in eager.step():
            want[chunk.request_id] += chunk.token_ids
    assert all(tokens[r][0] == want[r][0] for r in tokens)  # first tokens: the same prefill step
    assert sum(tokens[r] == want[r] for r in tokens) >= 2


def test_a_chain_graph_drafts_what_the_draft_graphs_draft(tiny_official_ckpt):
    """A speculative step's N drafts in one replay of a chain graph (the draws inside it) equal
    the same step drafted through N replays of the draft graph with a draw between them, bit for
    bit, for greedy, seeded temperature and min_p rows, beside a padding row of the bucket. A row
    with top-k is not one the chain graph draws (its step drafts step by step)."""
    import copy

    from model import speculation
    from model.batch import ForwardBatch
    from model.kv_pool import SeqKV

    options = WorkerOptions(str(tiny_official_ckpt), "", kv_dtype="fp8_pack", max_tokens=512, max_seqs=4,
                            device="cuda", kernels="triton", speculative_tokens=3, decode_graphs=(1, 4))
    _, model, pools = load_replica(options)
    graphs = DecodeGraphs(model, pools, options.decode_graphs, options.max_tokens, tokens_per_row=4)
    g = torch.Generator().manual_seed(5)
    seqs, lasts = [SeqKV() for _ in range(3)], []
    for seq, k in zip(seqs, (150, 37, 90)):
        prompt = torch.randint(0, 256, (k,), generator=g).tolist()
        pools.reserve(seq, k + 8)
        batch = ForwardBatch.build([(seq, prompt)], "cuda")
        lasts.append(int(model(batch, pools).argmax(-1)))
        batch.commit()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=4),
              SamplingParams(temperature=1.2, seed=9, min_p=0.05)]
    twin = copy.deepcopy(pools)  # the same contents for the second drafting

    def chain(pools, **graph):
        requests = [(s, t, 3, p) for s, t, p in zip(seqs, lasts, params)]
        return speculation.draft(model, pools, requests, on_device=True, **graph)[0].chain

    stepwise = chain(pools, graph_for=graphs.draft_for_rows)
    graph = graphs.chain_for_rows(3)
    assert graph.B == 4 and graph.chain == 3
    graph.chain_ids.fill_(-1)
    one = chain(twin, graph_for=graphs.draft_for_rows, chain_for=graphs.chain_for_rows)
    assert torch.equal(graph.chain_ids[:3], one)  # drawn by the chain graph's replay
    assert one.shape == (3, 4) and torch.equal(one, stepwise)
    assert not graph.draws.capturable([SamplingParams(1.0, top_k=5)])


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=7)])
def test_speculative_steps_queued_ahead_emit_what_steps_one_at_a_time_emit(tiny_official_ckpt, monkeypatch,
                                                                          sampling):
    """Overlapped speculative steps (`overlap.launch_speculative`: the next step queued on the
    device before the host learns how many drafts this one kept, placed by the device) against
    the same engine without overlap, both replaying the same graphs of one row: with the accepted
    counts forced (every count from 0 to N, from one seeded stream in both runs), the same
    tokens bit for bit, most steps queued ahead, and every page back."""
    import random

    from model import speculation
    from model.batch import to_device

    options = WorkerOptions(str(tiny_official_ckpt), "", kv_dtype="fp8_pack", max_tokens=512, max_seqs=2,
                            device="cuda", kernels="triton", speculative_tokens=3, decode_graphs=(1,))
    g = torch.Generator().manual_seed(6)
    request = GenerateRequest("r", tuple(torch.randint(0, 256, (120,), generator=g).tolist()), max_tokens=40,
                              ignore_eos=True, sampling=sampling)

    def serve(overlap: bool):
        rng, counts = random.Random(11), []

        def accept_counts(drafts, targets):  # each leading draft kept with probability 0.6
            a = [next(k for k in range(drafts.shape[1] + 1) if k == drafts.shape[1] or rng.random() >= 0.6)
                 for _ in range(drafts.shape[0])]
            counts.extend(a)
            return to_device(a, drafts.device, torch.int64)

        monkeypatch.setattr(speculation, "accept_counts", accept_counts)
        cfg, model, pools = load_replica(options)
        graphs = DecodeGraphs(model, pools, options.decode_graphs, options.max_tokens, tokens_per_row=4)
        engine = DecodeEngine(model, pools, ByteTokenizer(cfg.vocab_size), "d",
                              DecodeConfig(max_running=2, speculative_tokens=3, overlap=overlap), graphs)
        engine.submit(request)
        tokens, ahead = [], 0
        while engine.has_work():
            for chunk in engine.step():
                assert chunk.error is None, chunk.error
                tokens += chunk.token_ids
            ahead += engine.ahead is not None
        assert pools.num_free() == engine.idle_free()
        return tokens, ahead, counts

    want, none_ahead, counts = serve(False)
    got, ahead, _ = serve(True)
    assert none_ahead == 0 and ahead >= 5
    assert set(counts) == {0, 1, 2, 3}
    assert len(got) == 40 and got == want
