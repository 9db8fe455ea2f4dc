"""Speculative decoding through the MTP block (`model/speculation.py`) on the CPU reference path:
the MTP layer's KV follows the main layers' through every forward, a rejected draft leaves the
pools as if it had never been fed, and `generate` gives the tokens and logits of decoding without
speculation at every depth, greedy and sampled. The accept path at high acceptance is in
tests/model/test_speculation_fitted.py."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from model import speculation
from model.batch import ForwardBatch
from model.generate import generate
from model.kv_pool import STATE_KINDS, KVPools, SeqKV
from model.sampling import SamplingParams, sample_rows
from model.tiny import random_model, random_weights, tiny_config
from model.transformer import Transformer


@pytest.fixture(scope="module")
def model() -> Transformer:
    return random_model(tiny_config(), with_mtp=True)


def prompt(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def pools_for(model: Transformer, with_mtp: bool = True, max_tokens: int = 512) -> KVPools:
    return KVPools(model.cfg, "fp32", page_size=128, max_tokens=max_tokens, max_seqs=2, with_mtp=with_mtp)


def prefill(model: Transformer, pools: KVPools, ids: list[int], chunks: list[int]) -> SeqKV:
    seq = SeqKV()
    pools.reserve(seq, 400)
    start = 0
    for n in chunks + [len(ids) - sum(chunks)]:
        batch = ForwardBatch.build([(seq, ids[start:start + n])])
        model(batch, pools)
        batch.commit()
        start += n
    return seq


def mtp_bytes(pools: KVPools, seq: SeqKV, positions: int) -> torch.Tensor:
    """The MTP layer's SWA entries of positions [0, positions) and its `state_mtp` slot, as bytes."""
    idx = torch.arange(positions)
    layer = pools.mtp_layer
    swa = pools.read("swa", layer, seq.pages["swa"], idx)
    slot = pools.read("state_mtp", layer, seq.pages["state_mtp"], torch.zeros(1, dtype=torch.long))
    return torch.cat([swa.flatten(), slot.flatten()])


def test_every_forward_extends_the_mtp_layer_as_the_block_run_on_its_own_would(model):
    """Prefill in one chunk or in chunks (the MTP position at each chunk's end waits for the next
    chunk's first token, beside the streams kept in `state_mtp`) writes the MTP layer's KV of the
    block run once over the whole prompt: streams at t beside token t+1."""
    ids = prompt(70)
    one = pools_for(model)
    whole = prefill(model, one, ids, [])
    chunked_pools = pools_for(model)
    chunked = prefill(model, chunked_pools, ids, [1, 20, 13])
    assert torch.equal(mtp_bytes(one, whole, 69), mtp_bytes(chunked_pools, chunked, 69))

    ref_pools = pools_for(model, max_tokens=512)
    main, draft = SeqKV(), SeqKV()
    ref_pools.reserve(main, 100)
    ref_pools.reserve(draft, 100)
    batch = ForwardBatch.build([(main, ids)])
    _, streams = model(batch, ref_pools, return_streams=True)
    model.forward_mtp(streams[:-1], ForwardBatch.build([(draft, ids[1:])]), ref_pools)
    layer = one.mtp_layer
    assert torch.equal(one.read("swa", layer, whole.pages["swa"], torch.arange(69)),
                       ref_pools.read("swa", layer, draft.pages["swa"], torch.arange(69)))
    slot = one.read("state_mtp", layer, whole.pages["state_mtp"], torch.zeros(1, dtype=torch.long))
    assert torch.equal(slot.view(streams[-1].shape), streams[-1])


def state_bytes(pools: KVPools, seq: SeqKV) -> dict[str, torch.Tensor]:
    return {k: pools.buffers[k][seq.pages[k][0]].clone() for k in STATE_KINDS if k in pools.kinds_for()}


@pytest.mark.parametrize("mtp_ratio", [0, 4])
def test_a_rejected_run_leaves_the_pools_as_plain_decoding_does(model, mtp_ratio):
    """A verify across a ratio-4 and a ratio-128 window end (positions 126..129) whose drafts are
    all wrong, or right but two: the compress rings (the MTP layer's too, when it compresses) and
    the MTP slot afterwards are the bytes of plain decoding at the same length, and so are the
    next step's logits."""
    if mtp_ratio:
        cfg = tiny_config(compress_ratios=[*model.cfg.compress_ratios, mtp_ratio])
        model = Transformer(cfg, with_mtp=True)
        model.load_state_dict(random_weights({k: v.shape for k, v in model.state_dict().items()}, cfg, 0))
        assert model.cfg.num_hidden_layers in model.cfg.layers_with_ratio(4, with_mtp=True)
    ids = prompt(126, seed=2)
    params = SamplingParams()
    for accept in (0, 2):
        pools = pools_for(model)
        seq = prefill(model, pools, ids, [])
        ref_pools = pools_for(model)
        ref = prefill(model, ref_pools, ids, [])
        last = 7
        truth = []
        for _ in range(accept + 1):  # what plain decoding samples from `last` on
            b = ForwardBatch.build([(ref, [truth[-1] if truth else last])])
            out = model(b, ref_pools)
            b.commit()
            truth.append(sample_rows(out, [params], [ref.num_tokens])[0])
        pending = speculation.draft(model, pools, [(seq, last, 3, params)])[0]
        wrong = [(t + 1) % 256 for t in truth]
        pending = dataclasses.replace(pending, drafts=tuple(truth[:accept] + wrong[accept:] + [5] * 3)[:3])
        batch = ForwardBatch.build([(seq, pending.tokens)])
        out, streams = model(batch, pools, all_logits=True, return_streams=True)
        batch.commit()
        targets = sample_rows(out, [params] * 4, list(range(seq.num_tokens - 3, seq.num_tokens + 1)))
        emitted = speculation.settle(pools, [pending], [targets], streams, [0])[0]
        assert emitted == truth and seq.num_tokens == ref.num_tokens == 126 + accept + 1
        assert all(torch.equal(a, b) for a, b in zip(state_bytes(pools, seq).values(),
                                                      state_bytes(ref_pools, ref).values()))
        nxt = [ForwardBatch.build([(s, [truth[-1]])]) for s in (seq, ref)]
        assert torch.equal(model(nxt[0], pools), model(nxt[1], ref_pools))


GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.8, seed=11)
CASES = [(GREEDY, 3), (SAMPLED, 2)]  # the rest of the matrix: exhaustive (CI is near its time cap)
ALL_CASES = [(p, n) for p in (GREEDY, SAMPLED) for n in (1, 2, 3) if (p, n) not in CASES]
REFERENCES: dict[SamplingParams, object] = {}  # plain generate's answer per sampling, computed once


def assert_speculation_changes_no_token(model, params: SamplingParams, n: int) -> None:
    """Prompt and completion cross ratio-4 windows and a ratio-128 window end (position 127): at
    depth n the tokens and each token's logits are those of plain `generate` (on pools without the
    MTP layer), and a draft was proposed at every step that could take one."""
    ids = prompt(118, seed=3)
    if params not in REFERENCES:
        REFERENCES[params] = generate(model, pools_for(model, with_mtp=False), ids, 14, params, keep_logits=True)
    ref = REFERENCES[params]
    got = generate(model, pools_for(model), ids, 14, params, keep_logits=True, speculative_tokens=n)
    assert got.token_ids == ref.token_ids
    assert torch.equal(got.logits, ref.logits)
    assert got.finish_reason == ref.finish_reason
    assert got.proposed >= 13 // (n + 1) and 0 <= got.accepted <= got.proposed


@pytest.mark.parametrize("params,n", CASES, ids=lambda v: str(v) if isinstance(v, int) else f"t{v.temperature}")
def test_generate_speculates_without_changing_a_token(model, params, n):
    assert_speculation_changes_no_token(model, params, n)


@pytest.mark.exhaustive
@pytest.mark.parametrize("params,n", ALL_CASES, ids=lambda v: str(v) if isinstance(v, int) else f"t{v.temperature}")
def test_generate_speculates_without_changing_a_token_at_every_depth(model, params, n):
    assert_speculation_changes_no_token(model, params, n)


def test_generate_stops_inside_an_accepted_run_as_without_speculation(model):
    """A stop token the speculative step emits in the middle of its run ends the generation there."""
    ids = prompt(20, seed=4)
    ref = generate(model, pools_for(model, with_mtp=False), ids, 8, SamplingParams())
    stop = frozenset({ref.token_ids[4]})
    want = generate(model, pools_for(model, with_mtp=False), ids, 8, SamplingParams(), stop_ids=stop)
    got = generate(model, pools_for(model), ids, 8, SamplingParams(), stop_ids=stop, speculative_tokens=3)
    assert got.token_ids == want.token_ids and got.finish_reason == "stop"


def test_speculation_refuses_a_model_or_pools_without_the_mtp_block(model):
    plain = Transformer(model.cfg)
    with pytest.raises(ValueError, match="MTP block"):
        generate(plain, pools_for(model), [1, 2], 4, SamplingParams(), speculative_tokens=1)
    with pytest.raises(ValueError, match="MTP layer"):
        generate(model, pools_for(model, with_mtp=False), [1, 2], 4, SamplingParams(), speculative_tokens=1)
    with pytest.raises(ValueError, match="0..3"):
        generate(model, pools_for(model), [1, 2], 4, SamplingParams(), speculative_tokens=4)
