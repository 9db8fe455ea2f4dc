"""Invariant 1 on the CPU: a request's logits and tokens are the same bits alone or batched with
requests of other lengths, in one chunk or many, at any thread count, and in four `v4serve
generate` processes started together. The model's `index_topk` is 16 and the prompts 600+ tokens
(`invariance_cases`), so the indexer's picks hang on exact ties, which the first test checks
happen. The engines' cases (batches, prefix-cache hits, P/D, migration) are in
tests/prefill_worker/test_prefill_engine.py and tests/decode_worker/.

Below them, the ops they stand on (`model/kernels/common/invariant.py`) and the one tie-break rule
of every top-k, which the torch reference and the Triton kernels apply alike."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from model.batch import ForwardBatch
from model.checkpoint import expected_shapes, load_checkpoint, write_checkpoint
from model.kernels.attention import indexer
from model.kernels.common import invariant
from model.kernels.moe import moe_gate
from model.kv_pool import KVPools, SeqKV
from model.sampling import SamplingParams
from model.tiny import random_weights
from tests.model.invariance_cases import long_prompts, reference, tie_model
from worker_runtime.wire import GenerateRequest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model():
    return tie_model()


def request(rid: str, prompt: list[int], max_tokens: int = 6, **sampling) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), max_tokens, SamplingParams(**sampling), ignore_eos=True)


# ---------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------

def crossing_ties(scores: torch.Tensor, positions: torch.Tensor, k: int) -> bool:
    """Whether some query has more causal entries equal to its k-th best score than places left
    for them: its picks then hang on the tie-break."""
    n = scores.shape[1]
    future = torch.arange(n) >= ((positions + 1) // 4).unsqueeze(1)
    masked = scores.masked_fill(future, float("-inf"))
    kth = masked.topk(min(k, n), dim=-1).values[:, -1:]
    tied = ((masked == kth) & ~future).sum(1)
    return bool((((masked > kth).sum(1) + tied > k) & kth.squeeze(1).isfinite()).any())


def test_generate_gives_the_same_bits_at_every_chunk_size(model, monkeypatch):
    prompt = long_prompts(1, [650])[0]
    req = request("c", prompt, temperature=0.8, seed=3)
    ties = []
    select = indexer.select
    monkeypatch.setattr(indexer, "select", lambda s, p, k: (ties.append(crossing_ties(s, p, k)), select(s, p, k))[1])
    tokens, logits = reference(model, req)
    assert any(ties)  # a case where the tie-break decides picks
    for chunk in (256, 64, 97):
        got_tokens, got_logits = reference(model, req, chunk_size=chunk)
        assert got_tokens == tokens, chunk
        assert torch.equal(got_logits, logits), chunk
    short = request("s", prompt[:170], max_tokens=3)  # token by token: a decode step per prompt token
    tokens, logits = reference(model, short)
    got_tokens, got_logits = reference(model, short, chunk_size=1)
    assert got_tokens == tokens and torch.equal(got_logits, logits)


def test_batched_prefill_and_decode_rows_equal_the_request_alone(model):
    """Four requests of 640, 301, 45 and 700 tokens: the first three prefill in one batch beside
    the first 200 tokens of the last, which completes its prompt beside their first decode step;
    then all decode together."""
    prompts = long_prompts(2, [640, 301, 45, 700])
    reqs = [request(f"b{i}", p, max_tokens=4) for i, p in enumerate(prompts)]
    pools = KVPools(model.cfg, "fp32", max_tokens=800, max_seqs=4)
    seqs = [SeqKV() for _ in reqs]
    for seq, r in zip(seqs, reqs):
        pools.reserve(seq, len(r.prompt_ids) + r.max_tokens)
    rows = [[] for _ in reqs]  # each request's logits rows that sample a token

    def feed(i: int) -> list[int]:  # the rest of the prompt (at most 200 tokens at first), or the last token
        if rows[i]:
            return [int(rows[i][-1].argmax())]
        done = seqs[i].num_tokens
        return prompts[i][done:done + 200] if i == 3 and done == 0 else prompts[i][done:]

    while any(len(r) < 4 for r in rows):
        active = [i for i in range(4) if len(rows[i]) < 4]
        batch = ForwardBatch.build([(seqs[i], feed(i)) for i in active])
        logits = model(batch, pools)
        batch.commit()
        for row, i in enumerate(active):
            if seqs[i].num_tokens >= len(prompts[i]):
                rows[i].append(logits[row])
            pools.trim_window(seqs[i])
    assert len(prompts[3]) > 200 and len(rows[3]) == 4
    for r, got in zip(reqs, rows):
        tokens, logits = reference(model, r)
        assert torch.equal(torch.stack(got), logits), r.request_id
        assert torch.stack(got).argmax(-1).tolist() == tokens


def test_generate_gives_the_same_bits_at_any_thread_count(model):
    req = request("t", long_prompts(3, [620])[0], max_tokens=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        tokens, logits = reference(model, req)
        torch.set_num_threads(1)
        got_tokens, got_logits = reference(model, req)
    finally:
        torch.set_num_threads(threads)
    assert got_tokens == tokens and torch.equal(got_logits, logits)


@pytest.mark.slow
def test_four_generate_processes_started_together_give_the_same_logits(tmp_path):
    """What the load case does: four `v4serve generate` runs share two cores; their logits are the
    bits of this process's own run (at this process's thread count), and of a run on one thread."""
    cfg = tie_model().cfg
    ckpt = write_checkpoint(tmp_path / "ckpt", cfg, random_weights(expected_shapes(cfg, with_mtp=True), cfg, 0),
                            "official")
    prompt = long_prompts(4, [660])[0]
    args = [sys.executable, "-m", "cluster.cli", "generate", "--model", str(ckpt), "--max-new-tokens", "4",
            "--prompt-ids", ",".join(map(str, prompt)), "--temperature", "0.7", "--seed", "5"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = [subprocess.Popen(args + ["--logits-out", str(tmp_path / f"l{i}.npy")], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for i in range(4)]
    runs.append(subprocess.Popen(args + ["--logits-out", str(tmp_path / "l4.npy")], cwd=ROOT,
                                 env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for p in runs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err.decode()[-2000:]
    _, loaded = load_checkpoint(ckpt)
    _, logits = reference(loaded, request("x", prompt, max_tokens=4, temperature=0.7, seed=5))
    for i in range(5):
        assert torch.equal(torch.from_numpy(np.load(tmp_path / f"l{i}.npy")), logits), i


# ---------------------------------------------------------------------------------------
# the ops
# ---------------------------------------------------------------------------------------

def test_product_rows_depend_on_their_own_values_alone():
    g = torch.Generator().manual_seed(0)
    for K, N in [(64, 320), (2048, 64), (3, 5)]:
        w = torch.randn(N, K, generator=g)
        x = torch.randn(300, K, generator=g) * torch.rand(300, 1, generator=g) * 8
        full = invariant.linear(x, w)
        for lo, hi in [(0, 1), (0, 2), (5, 8), (17, 300), (299, 300)]:
            assert torch.equal(invariant.linear(x[lo:hi].clone(), w), full[lo:hi]), (K, lo, hi)
        exact = x.double() @ w.double().t()
        assert ((full.double() - exact).abs() <= 2 ** -19 * (x.abs().double() @ w.abs().double().t())).all()


def test_products_do_not_depend_on_the_thread_count():
    """BLAS splits a long K over threads (float32 x·Wᵀ then differs in its last bits); the exact sums
    do not."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(64, 4096, generator=g), torch.randn(700, 4096, generator=g)
    keys, p = torch.randn(90, 128, generator=g), torch.rand(700, 90, generator=g)
    threads = torch.get_num_threads()
    try:
        out = []
        for n in (2, 1):
            torch.set_num_threads(n)
            out.append((invariant.linear(x, w), invariant.mix(p, invariant.Rows.of(keys))))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_mix_and_sums_ignore_zero_padding():
    """What chunking and batching change: a row's width (a batch's widest picks) and its place."""
    g = torch.Generator().manual_seed(2)
    keys, p = torch.randn(40, 128, generator=g), torch.rand(3, 40, generator=g)
    padded_keys = torch.cat([keys, torch.randn(24, 128, generator=g)])
    padded_p = torch.cat([p, torch.zeros(3, 24)], dim=1)
    assert torch.equal(invariant.mix(p, invariant.Rows.of(keys), k_max=64),
                       invariant.mix(padded_p, invariant.Rows.of(padded_keys), k_max=64))
    x = torch.randn(5, 37, 3, generator=g)
    for dim in (1, -1):
        s = invariant.sum(x, dim)
        assert torch.equal(invariant.sum(torch.cat([x, torch.zeros_like(x)], dim), dim), s)
        assert torch.equal(invariant.sum(x[2:3], dim), s[2:3])
    soft = invariant.softmax(x, 1)
    assert torch.equal(invariant.softmax(torch.cat([x, torch.full((5, 50, 3), float("-inf"))], 1), 1)[:, :37], soft)
    assert torch.allclose(soft, torch.softmax(x, 1), rtol=1e-6, atol=1e-7)


def test_activations_do_not_depend_on_where_an_element_lies():
    """torch's own sigmoid / SiLU / softplus compute a tensor's tail apart from its body."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 6
    refs = {invariant.sigmoid: torch.sigmoid, invariant.silu: torch.nn.functional.silu,
            invariant.softplus: torch.nn.functional.softplus}
    for f, ref in refs.items():
        full = f(x)
        for n in (1, 7, 16, 33, 100):
            for off in (0, 3):
                assert torch.equal(f(x[off:off + n].clone()), full[off:off + n]), (f.__name__, n, off)
        assert torch.allclose(full, ref(x), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------
# the tie-break rule
# ---------------------------------------------------------------------------------------

def test_top_k_takes_the_lower_index_among_equal_values():
    v = torch.tensor([[1.0, 0.0, -0.0, 3.0, 0.0, 3.0, -1.0, 0.0]])
    values, ids = invariant.top_k(v, 5)
    assert ids.tolist() == [[3, 5, 0, 1, 2]] and values.tolist() == [[3.0, 3.0, 1.0, 0.0, 0.0]]


def test_indexer_select_and_kernel_break_ties_alike():
    """Rows of ReLU-like scores (zeros of both signs, repeated values) cut by K inside a tie: the
    reference and the select kernel name the same entries, the lowest of the tie."""
    g = torch.Generator().manual_seed(4)
    R, n, K = 6, 96, 16
    scores = torch.randn(R, n, generator=g).relu() * torch.randint(0, 3, (R, n), generator=g) / 4
    scores[torch.rand(R, n, generator=g) < 0.3] *= -1  # -0.0 among the zeros
    scores[1:3] = 0.0
    scores[2, ::2] = -0.0  # zeros of alternating sign: one tie
    positions = torch.full((R,), 4 * n - 1)
    positions[3] = 4 * 10 - 1  # fewer causal entries than K
    ref = indexer.select(scores, positions, K).int()
    future = torch.arange(n) >= ((positions + 1) // 4).unsqueeze(1)
    got = indexer.top_k(scores.masked_fill(future, float("-inf")), K)
    assert torch.equal(got, ref)
    assert ref[1].tolist() == list(range(K)) and ref[2].tolist() == list(range(K))


def test_moe_routing_breaks_ties_by_the_lower_expert_alike():
    """Equal selection scores: the reference and the routing kernel pick the same experts in the
    same slot order (descending score, then expert id), so the slot sums agree too."""
    E, k = 8, 3
    logits = torch.tensor([[0.5, 1.0, 1.0, 0.2, 1.0, 1.0, -1.0, 0.0],
                           [0.0] * 8,
                           [2.0, -1.0, 2.0, 2.0, 0.5, 0.5, 0.5, 2.0]])
    bias = torch.zeros(E)
    ids = torch.zeros(3, dtype=torch.long)
    ref_w, ref_ids = moe_gate.route(logits, bias, None, ids, k, "sqrtsoftplus", True, 1.5, "torch")
    assert ref_ids.tolist() == [[1, 2, 4], [0, 1, 2], [0, 2, 3]]
    got_w, got_ids = moe_gate.route(logits, bias, None, ids, k, "sqrtsoftplus", True, 1.5, "triton")
    assert torch.equal(got_ids, ref_ids)
    assert torch.allclose(got_w, ref_w, rtol=1e-6)
