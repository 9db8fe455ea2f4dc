"""min_p and prompt logprobs on the GPU: min_p's support through the Triton draw gives the CPU's
tokens from the same logits at V4's vocabulary; the prefill and decode engines' prompt logprobs on
the device-format model (Triton kernels, fp8_pack pools) are the log-softmax of that model's own
logits at every prompt position. The model runs `--deterministic` (batch-invariant kernels), so
the engines' differently chunked steps give the reference forward's logits bit for bit and the
comparison can be tight; without it a chunk of 64 rows picks other tiles than one of 200, and
bf16 / FP8 rounding moves a logprob by a few hundredths."""

from __future__ import annotations

import pytest
import torch

from decode_worker.engine import DecodeConfig, DecodeEngine
from model.batch import ForwardBatch
from model.checkpoint import load_checkpoint
from model.kernels import set_deterministic
from model.kv_pool import KVPools, SeqKV
from model.quantized import quantize_model
from model.sampling import SamplingParams, sample_rows
from model.tokenizer import ByteTokenizer
from prefill_worker.engine import PrefillConfig, PrefillEngine
from worker_runtime.wire import GenerateRequest

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB = 129280  # V4's
PROMPT = tuple((i * 37 + 5) % 250 for i in range(200))


def test_min_p_draws_on_the_gpu_what_the_cpu_draws():
    params = [SamplingParams(temperature=0.7 + 0.1 * (i % 4), seed=i, min_p=(0.0, 0.05, 0.3, 1.0)[i % 4],
                             top_k=(0, 50)[i % 2], top_p=(1.0, 0.9, 1.0)[i % 3]) for i in range(32)]
    logits = torch.randn(32, VOCAB, generator=torch.Generator().manual_seed(4)) * 4
    positions = list(range(7, 39))
    assert sample_rows(logits.cuda(), params, positions) == sample_rows(logits, params, positions)


@pytest.fixture(scope="module")
def gpu_model(tiny_official_ckpt):
    _, model = load_checkpoint(tiny_official_ckpt, device="cuda")
    quantize_model(model, "triton")
    set_deterministic(model, True)
    return model


def reference(model) -> torch.Tensor:
    """log-softmax of the model's own logits at every prompt position, one forward."""
    pools, seq = KVPools(model.cfg, "fp8_pack", max_tokens=512, max_seqs=1, device="cuda"), SeqKV()
    pools.reserve(seq, len(PROMPT))
    logits = model(ForwardBatch.build([(seq, list(PROMPT))], device="cuda"), pools, all_logits=True)
    return torch.log_softmax(logits.double(), -1).cpu()


def check(lps, ref: torch.Tensor) -> None:
    assert [lp.token for lp in lps] == list(PROMPT[1:])
    for i, lp in enumerate(lps):
        assert abs(lp.logprob - ref[i, lp.token].item()) < 1e-4, i  # fp32 against float64 softmax
        assert len(lp.top) == 5


def test_engines_prompt_logprobs_on_the_gpu(gpu_model):
    ref = reference(gpu_model)
    prefill = PrefillEngine(gpu_model, KVPools(gpu_model.cfg, "fp8_pack", max_tokens=512, max_seqs=2, device="cuda"),
                            "p0", PrefillConfig(token_budget=512))
    prefill.submit(GenerateRequest("p", PROMPT, 1, prompt_logprobs=5))
    done = []
    while not done:
        done = prefill.step()
    check(done[0].prompt_logprobs, ref)
    decode = DecodeEngine(gpu_model, KVPools(gpu_model.cfg, "fp8_pack", max_tokens=512, max_seqs=2, device="cuda"),
                          ByteTokenizer(gpu_model.cfg.vocab_size), "d0", DecodeConfig(prefill_token_budget=64))
    decode.submit(GenerateRequest("d", PROMPT, 2, ignore_eos=True, prompt_logprobs=5))
    chunks = []
    while not decode.idle():
        chunks += decode.step()
    check(chunks[0].prompt_logprobs, ref)
