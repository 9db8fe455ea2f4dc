"""`--deterministic` on the GPU: with the batch-invariant kernel configurations
(`kernels.set_deterministic`), a request's logits are the same bits alone, in batches of 7 and 64,
prefilled whole or in chunks of 512 or 2048, and decoded one token a step or in verify-shaped
steps of 4, on full-width V4-Flash layers (dummy device-format weights: FP8 projections, FP4
experts, fp8_pack pools; sliding-window, CSA and HCA layers, hash- and score-routed MoE); and
speculative `generate` gives plain decoding's tokens and logits, bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from decode_worker.engine import DecodeConfig, DecodeEngine
from model import speculation
from model.batch import ForwardBatch
from model.dummy_weights import dummy_model
from model.generate import generate
from model.kernels import set_deterministic
from model.kv_pool import KVPools, SeqKV
from model.sampling import SamplingParams
from model.tiny import flash_config
from model.tokenizer import ByteTokenizer
from tests.decode_worker.test_decode_engine import run_all
from worker_runtime.model_loader import DecodeGraphs, load_replica
from worker_runtime.options import WorkerOptions
from worker_runtime.wire import GenerateRequest

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT_LEN = 2500
# positions of the target request whose logits are compared: both sides of every chunk boundary
# of 512 and 2048, and the last
WATCHED = sorted({0, 1, 255, 256, 511, 512, 513, 1023, 1024, 1500, 2047, 2048, 2049, PROMPT_LEN - 1})
FED = [17, 4242, 99, 123, 7, 65000, 31, 8]  # the target's decode inputs, the same in every run
MAX_TOKENS = 4096


@pytest.fixture(scope="module")
def flash():
    cfg = flash_config(4)  # window-only, window-only, ratio 4, ratio 128
    model = dummy_model(cfg, "triton", "cuda", act_fp8=True)
    set_deterministic(model, True)
    return model


def _target_logits(model, companions: int, chunk: int, verify: int = 1, seed: int = 0) -> torch.Tensor:
    """The target request's logits at `WATCHED` prompt positions, then at each decode step of
    `FED`, run among `companions` other requests of random lengths (the target in the middle of
    the batch), the prompts prefilled in steps of `chunk` tokens a request, the decode inputs fed
    `verify` tokens a step (a verify-shaped segment) while each companion decodes one."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, cfg.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(123)).tolist()
    # (63 companions up to 1,400 tokens: a first step of 41K tokens, within `kernel_step_limit`)
    others = [torch.randint(0, cfg.vocab_size, (int(torch.randint(1, 1400, (1,), generator=g)),),
                            generator=g).tolist() for _ in range(companions)]
    prompts = others[:companions // 2] + [target] + others[companions // 2:]
    me = companions // 2
    pools = KVPools(cfg, "fp8_pack", max_tokens=MAX_TOKENS, max_seqs=companions + 1, device="cuda")
    seqs = [SeqKV() for _ in prompts]
    for s, p in zip(seqs, prompts):
        pools.reserve(s, len(p) + len(FED))
    rows = []
    for start in range(0, PROMPT_LEN, chunk):
        items = [(s, p[start:start + chunk]) for s, p in zip(seqs, prompts) if p[start:start + chunk]]
        batch = ForwardBatch.build(items, device="cuda")
        seg = next(sg for sg in batch.segments if sg.seq is seqs[me])
        wanted = [seg.offset + p - start for p in WATCHED if start <= p < start + seg.length]
        logits = model(batch, pools, logit_rows=torch.tensor(wanted, dtype=torch.long, device="cuda"))
        rows.append(logits.float().cpu())
        batch.commit()
    for lo in range(0, len(FED), verify):
        fed = FED[lo:lo + verify]
        items = [(s, fed if i == me else [int(torch.randint(0, cfg.vocab_size, (1,), generator=g))])
                 for i, s in enumerate(seqs)]
        batch = ForwardBatch.build(items, device="cuda")
        seg = next(sg for sg in batch.segments if sg.seq is seqs[me])
        logits = model(batch, pools, logit_rows=torch.arange(seg.offset, seg.offset + seg.length, device="cuda"))
        rows.append(logits.float().cpu())
        batch.commit()
    return torch.cat(rows)


@pytest.mark.parametrize("companions, chunk, verify", [(0, 512, 1), (0, 2048, 1), (6, 512, 1), (6, 2048, 4),
                                                       (63, 2048, 1), (63, 512, 4)])
def test_a_requests_logits_do_not_depend_on_its_batch_or_chunking(flash, companions, chunk, verify):
    alone = _target_logits(flash, 0, PROMPT_LEN)  # the whole prompt in one step, then one token a step
    got = _target_logits(flash, companions, chunk, verify)
    assert alone.shape == (len(WATCHED) + len(FED), flash.cfg.vocab_size)
    assert alone.isfinite().all() and alone.std() > 0.1
    diff = (got - alone).abs().amax(dim=-1)
    assert torch.equal(got, alone), f"rows differing (max |Δ| per row): {diff.tolist()}"


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculative_generate_is_plain_decoding_bit_for_bit(tiny_official_ckpt, n, temperature):
    options = WorkerOptions(str(tiny_official_ckpt), "", kv_dtype="fp8_pack", max_tokens=512, max_seqs=1,
                            device="cuda", kernels="triton", speculative_tokens=n, deterministic=True)
    cfg, model, pools = load_replica(options)
    assert model.mtp and pools.with_mtp and model.deterministic
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(temperature=temperature, seed=5)
    plain_pools = KVPools(cfg, "fp8_pack", max_tokens=512, max_seqs=1, device="cuda", with_mtp=True)
    plain = generate(model, plain_pools, prompt, 32, params, keep_logits=True)
    got = generate(model, pools, prompt, 32, params, keep_logits=True, speculative_tokens=n)
    assert got.token_ids == plain.token_ids
    assert torch.equal(got.logits, plain.logits)
    assert got.proposed > 0


def test_speculation_on_full_width_layers_is_plain_decoding_bit_for_bit():
    cfg = flash_config(4)
    model = dummy_model(cfg, "triton", "cuda", act_fp8=True, with_mtp=True)
    set_deterministic(model, True)
    prompt = torch.randint(0, cfg.vocab_size, (700,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(temperature=0.8, seed=3)

    def run(n: int):
        pools = KVPools(cfg, "fp8_pack", max_tokens=1024, max_seqs=1, device="cuda", with_mtp=True)
        return generate(model, pools, prompt, 16, params, chunk_size=512, keep_logits=True, speculative_tokens=n)

    plain = run(0)
    for n in (1, 2, 3):
        got = run(n)
        assert got.token_ids == plain.token_ids, n
        assert torch.equal(got.logits, plain.logits), n


def test_graph_speculation_drafts_and_emits_what_eager_speculation_does(tiny_official_ckpt, monkeypatch):
    """Speculative steps replaying CUDA graphs (verify steps with the MTP extension inside, drafts
    in one chain replay, batched ring roll-back) against the same engine run eagerly and against
    plain decoding, under --deterministic: the same drafts and targets at every step, bit for bit
    (so the MTP layer's KV and slots are the same), and plain decoding's tokens; and with the
    steps queued ahead (`overlap.launch_speculative`, the default), plain decoding's tokens too,
    at real acceptance, with requests ending at different steps."""
    from decode_worker import overlap

    options = WorkerOptions(str(tiny_official_ckpt), "", kv_dtype="fp8_pack", max_tokens=512, max_seqs=4,
                            device="cuda", kernels="triton", speculative_tokens=2, decode_graphs=(1, 2, 4),
                            deterministic=True)
    g = torch.Generator().manual_seed(3)
    requests = [GenerateRequest(f"r{i}", tuple(torch.randint(0, 256, (k,), generator=g).tolist()),
                                max_tokens=20 + 3 * i, ignore_eos=True,
                                sampling=SamplingParams(temperature=0.8 * (i % 2), seed=i))
                for i, k in enumerate((150, 37, 90))]
    real, real_launch = speculation.accept_counts, overlap.launch_speculative

    def serve(spec: int, graphed: bool, ahead: bool = False):
        cfg, model, pools = load_replica(dataclasses.replace(options, speculative_tokens=spec))
        graphs = DecodeGraphs(model, pools, options.decode_graphs, options.max_tokens, tokens_per_row=spec + 1) \
            if graphed else None
        engine = DecodeEngine(model, pools, ByteTokenizer(cfg.vocab_size), "d",
                              DecodeConfig(max_running=4, speculative_tokens=spec, overlap=ahead), graphs)
        seen, launched = [], []
        monkeypatch.setattr(speculation, "accept_counts",
                            lambda d, t: seen.append((d.tolist(), t.tolist())) or real(d, t))
        monkeypatch.setattr(overlap, "launch_speculative", lambda *a: launched.append(1) or real_launch(*a))
        return run_all(engine, requests, [0] * len(requests)), seen, graphs, len(launched)

    plain, _, _, _ = serve(0, False)
    eager, eager_seen, _, _ = serve(2, False)
    graphed, graph_seen, graphs, _ = serve(2, True)
    assert graphs.replays > 0 and len(graph_seen) > 5
    assert graph_seen == eager_seen
    assert any(a != b for drafts, targets in graph_seen for row_d, row_t in zip(drafts, targets)
               for a, b in zip(row_d, row_t))  # some drafts were rejected
    assert graphed == eager == plain
    queued_ahead, _, _, launched = serve(2, True, ahead=True)
    assert launched > 3
    assert queued_ahead == plain
