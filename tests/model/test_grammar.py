"""model/grammar.py and the mask in model/sampling.py: a grammar's bitmask lets through exactly
its tokens, rows without a grammar are untouched, a request's state rebuilt from its output is
the state it had, and a bad grammar or token is refused. On a GPU (marked `gpu`), the mask applied
on the device and the masked draw give the CPU's result at V4's vocabulary size."""

import pytest
import torch

from model.grammar import CheckedGrammars, GrammarError, Grammars, check, from_json_schema, from_lark
from model.sampling import SamplingParams, apply_bitmask, sample_rows
from model.tokenizer import ByteTokenizer

VOCAB, EOS = 320, 257
TOK = ByteTokenizer(VOCAB)
DIGITS = from_lark('start: /[0-9]{1,3}/ "!"')


@pytest.fixture(scope="module")
def grammars():
    return Grammars(TOK, VOCAB, EOS)


def allowed(mask: torch.Tensor, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(mask[t // 32]) >> (t % 32)) & 1}


def test_mask_follows_the_grammar_and_leaves_other_rows_alone(grammars):
    state = grammars.state(DIGITS)
    masks = grammars.bitmask([None, state, None])
    assert masks.shape == (3, (VOCAB + 31) // 32) and masks.dtype == torch.int32
    assert allowed(masks[1], VOCAB) == set(TOK.encode("0123456789"))
    assert (masks[0] == -1).all() and (masks[2] == -1).all()
    for t in TOK.encode("42"):
        state.advance(t)
    assert allowed(grammars.bitmask([state])[0], VOCAB) == set(TOK.encode("0123456789!"))
    state.advance(TOK.encode("!")[0])
    assert state.done  # nothing may follow: the request ends here
    assert grammars.bitmask([None, None]) is None


def test_state_rebuilt_from_the_output_is_the_same(grammars):
    g = from_json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    out = TOK.encode('{"a":12')
    stepped = grammars.state(g)
    for t in out:
        stepped.advance(t)
    replayed = grammars.state(g, out)
    assert torch.equal(grammars.bitmask([stepped])[0], grammars.bitmask([replayed])[0])
    assert allowed(grammars.bitmask([replayed])[0], VOCAB) == set(TOK.encode("0123456789},"))


def test_refusals(grammars):
    with pytest.raises(GrammarError, match="not allowed"):
        grammars.state(DIGITS, TOK.encode("1a"))
    with pytest.raises(GrammarError):
        check(from_json_schema({"type": "objectx"}))
    with pytest.raises(GrammarError):
        grammars.prepare(from_lark("start: undefined_rule"))
    with pytest.raises(ValueError, match="int32"):
        apply_bitmask(torch.zeros(2, VOCAB), torch.zeros(2, 9, dtype=torch.int32))


@pytest.mark.parametrize("vocab", [320, 300])  # a width that is not a multiple of 32 too
def test_apply_bitmask_masks_exactly_the_cleared_bits(vocab):
    g = torch.Generator().manual_seed(vocab)
    masks = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    logits = torch.randn(3, vocab, generator=g)
    out = apply_bitmask(logits, masks)
    for r in range(3):
        keep = allowed(masks[r], vocab)
        assert all((out[r, t] == logits[r, t]) if t in keep else out[r, t] == float("-inf") for t in range(vocab))


def test_masked_sampling_draws_only_allowed_tokens(grammars):
    state = grammars.state(DIGITS)
    masks = grammars.bitmask([state, None])
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2)]
    digits = set(TOK.encode("0123456789"))
    for pos in range(20):
        a, _ = sample_rows(logits, params, [pos, pos], masks=masks)
        assert a in digits
    assert sample_rows(logits, [SamplingParams()] * 2, [0, 0], masks=masks)[1] == int(logits[1].argmax())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mask_and_masked_draw_on_the_gpu_equal_the_cpu():
    vocab, rows = 129280, 16
    g = torch.Generator().manual_seed(0)
    masks = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    masks[::3] = -1  # rows without a grammar
    logits = torch.randn(rows, vocab, generator=g)
    assert torch.equal(apply_bitmask(logits.cuda(), masks.cuda()).cpu(), apply_bitmask(logits, masks))
    params = [SamplingParams(temperature=0.8 * (i % 2), top_p=0.95, seed=i) for i in range(rows)]
    positions = list(range(rows))
    cpu = sample_rows(logits, params, positions, impl="torch", masks=masks)
    assert sample_rows(logits.cuda(), params, positions, masks=masks.cuda()) == cpu
    assert all((int(masks[i, t // 32]) >> (t % 32)) & 1 for i, t in enumerate(cpu))


def test_checked_grammars_remember_each_verdict():
    checked = CheckedGrammars(size=2)
    bad = from_json_schema({"type": "objectx"})
    for _ in range(2):  # the second time from the cache: the same verdict
        checked.check(DIGITS)
        with pytest.raises(GrammarError, match="objectx"):
            checked.check(bad)
    checked.check(from_lark('start: "x"'))  # evicts the oldest; it is checked again when it comes back
    with pytest.raises(GrammarError, match="objectx"):
        checked.check(bad)
