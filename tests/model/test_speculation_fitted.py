"""The accept path at high acceptance: a tiny model fitted within the test to a repeating text,
so that the MTP block's drafts are mostly the target's own tokens; speculation still changes no
token, and most drafts are accepted.

The fit is cheap because only the LM head is trained, and the head is the last op of both the
main model and the MTP block (they share it): the inputs it sees (the features) do not depend on
it. One forward over the text gives the main model's features (target: the next token) and the
MTP block's, at chain depth 1 (streams at t beside token t+1; target t+2) and depth 2 (its own
output streams beside token t+2; target t+3). A few hundred Adam steps of cross-entropy on them,
with torch autograd, fit the head; the blocks keep their random weights."""

from __future__ import annotations

import random

import pytest
import torch

from model.batch import ForwardBatch
from model.generate import generate
from model.kv_pool import KVPools, SeqKV
from model.sampling import SamplingParams
from model.tiny import random_weights, tiny_config
from model.transformer import Transformer

PERIOD = 10


def features(model: Transformer, text: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's inputs over `text` and the token each should predict."""
    seen: list[torch.Tensor] = []
    hook = model.head.register_forward_hook(lambda _m, args, _out: seen.append(args[0].detach().clone()))
    try:
        pools = KVPools(model.cfg, "fp32", page_size=128, max_tokens=256, max_seqs=4, with_mtp=True)
        main, d1, d2 = SeqKV(), SeqKV(), SeqKV()
        for s in (main, d1, d2):
            pools.reserve(s, len(text))
        _, streams = model(ForwardBatch.build([(main, text)]), pools, all_logits=True, return_streams=True)
        every = torch.arange(len(text) - 1)
        _, chained = model.mtp_step(streams[:-1], ForwardBatch.build([(d1, text[1:])]), pools, rows=every)
        model.mtp_step(chained[:-1], ForwardBatch.build([(d2, text[2:])]), pools, rows=every[:-1])
    finally:
        hook.remove()
    n = len(text)
    x = torch.cat([seen[0][: n - 1], seen[1][: n - 2], seen[2][: n - 3]])
    y = torch.tensor(text[1:] + text[2:] + text[3:])
    return x, y


def fitted_model(text: list[int]) -> Transformer:
    cfg = tiny_config()
    model = Transformer(cfg, with_mtp=True)
    model.load_state_dict(random_weights({k: v.shape for k, v in model.state_dict().items()}, cfg, 0))
    x, y = features(model, text)
    weight = model.head.weight.detach().clone().requires_grad_(True)
    opt = torch.optim.Adam([weight], lr=0.05)
    for _ in range(300):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ weight.T, y)
        loss.backward()
        opt.step()
    with torch.no_grad():
        model.head.weight.copy_(weight)
    return model


@pytest.fixture(scope="module")
def fitted():
    rng = random.Random(5)
    pattern = rng.sample(range(256), PERIOD)
    text = pattern * 8
    return fitted_model(text), pattern


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=2)], ids=["greedy", "t0.8"])
def test_a_fitted_draft_is_mostly_accepted_and_changes_no_token(fitted, params):
    model, pattern = fitted
    prompt = pattern * 3 + pattern[:4]
    cfg = model.cfg
    plain = generate(model, KVPools(cfg, "fp32", page_size=128, max_tokens=128, max_seqs=1), prompt, 24, params)
    assert plain.token_ids[:PERIOD] == (pattern[4:] + pattern[:4])  # the target follows the text
    got = generate(model, KVPools(cfg, "fp32", page_size=128, max_tokens=128, max_seqs=1, with_mtp=True), prompt, 24,
                   params, speculative_tokens=3)
    assert got.token_ids == plain.token_ids
    assert got.proposed >= 15 and got.accepted / got.proposed > 0.8, (got.accepted, got.proposed)


def test_an_fp8_draft_head_keeps_the_tokens_and_the_acceptance(fitted):
    """Drafts through the FP8 copy of the head (`Transformer.quantize_draft_head`, as GPU workers
    draft): its logits are not the exact head's, the tokens are still plain decoding's, and the
    fitted drafts are still mostly accepted."""
    import copy

    model, pattern = fitted
    model = copy.deepcopy(model)
    model.quantize_draft_head()
    cfg = model.cfg
    h = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    assert not torch.equal(model.draft_head(h), model.head(h))
    assert torch.allclose(model.draft_head(h), model.head(h), atol=0.1 * float(model.head(h).abs().max()))
    prompt = pattern * 3 + pattern[:4]
    params = SamplingParams(temperature=0.8, seed=2)
    plain = generate(model, KVPools(cfg, "fp32", page_size=128, max_tokens=128, max_seqs=1), prompt, 24, params)
    drafts = []
    model.draft_head.register_forward_hook(lambda _m, _args, out: drafts.append(out.shape[0]))
    got = generate(model, KVPools(cfg, "fp32", page_size=128, max_tokens=128, max_seqs=1, with_mtp=True), prompt, 24,
                   params, speculative_tokens=3)
    assert got.token_ids == plain.token_ids
    assert got.proposed >= 15 and got.accepted / got.proposed > 0.8, (got.accepted, got.proposed)
    assert sum(drafts) >= got.proposed  # every draft came through it
