"""Routing kernel against the torch reference (interpreter on CPU): scores, expert choice and
weights for score layers (every scoring function, with and without normalisation) and hash layers."""

import pytest
import torch

from model.kernels import arrival_counter
from model.kernels.moe import moe_gate

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows in expert order: the order of a row's experts is unspecified."""
    ids, order = ids.sort(dim=1)
    return weights.gather(1, order), ids


@pytest.mark.parametrize("scoring", moe_gate.SCORING)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("T,E,k", [(1, 256, 6), (13, 64, 6), (6, 48, 1)])
def test_score_routing_matches_reference(scoring, norm, T, E, k):
    g = torch.Generator().manual_seed(T * E + k)
    logits = (3 * torch.randn(T, E, generator=g)).to(DEVICE)
    # row 0 in softplus' tails: chosen experts with tiny scores (where log(1 + y) loses them) and
    # logits past the linear threshold
    logits[0] = -12 - 6 * torch.rand(E, generator=g).to(DEVICE)
    logits[0, :2] = torch.tensor([25.0, 60.0])
    bias = (0.5 * torch.randn(E, generator=g)).to(DEVICE)
    args = (logits, bias, None, torch.zeros(T, dtype=torch.long, device=DEVICE), k, scoring, norm, 2.5)
    w_ref, id_ref = _sorted(*moe_gate.route(*args, impl="torch"))
    w, ids = moe_gate.route(*args, impl="triton")
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (T, k)
    w, ids = _sorted(w, ids)
    assert torch.equal(ids, id_ref)
    torch.testing.assert_close(w, w_ref, rtol=2e-6, atol=1e-7)


def test_bias_steers_selection_only():
    """A large bias on some experts forces their choice, yet their weights stay their scores."""
    E, k = 32, 4
    logits = torch.randn(5, E, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    bias = torch.zeros(E, device=DEVICE)
    bias[[3, 7, 11, 30]] = 100.0
    w, ids = moe_gate.route(logits, bias, None, torch.zeros(5, dtype=torch.long, device=DEVICE), k, "sigmoid",
                          False, 1.0, impl="triton")
    assert torch.equal(ids.sort(dim=1).values, torch.tensor([[3, 7, 11, 30]] * 5, device=DEVICE))
    torch.testing.assert_close(w, logits.sigmoid().gather(1, ids), rtol=2e-6, atol=1e-7)


def test_hash_routing_matches_reference():
    g = torch.Generator().manual_seed(3)
    T, E, k, vocab = 9, 64, 6, 50
    logits = torch.randn(T, E, generator=g).to(DEVICE)
    table = torch.randint(0, E, (vocab, k), generator=g, dtype=torch.int32).to(DEVICE)
    tokens = torch.randint(0, vocab, (T,), generator=g).to(DEVICE)
    args = (logits, None, table, tokens, k, "sqrtsoftplus", True, 1.5)
    w_ref, id_ref = moe_gate.route(*args, impl="torch")
    w, ids = moe_gate.route(*args, impl="triton")
    assert torch.equal(ids, id_ref)  # the table's order is kept
    torch.testing.assert_close(w, w_ref, rtol=2e-6, atol=1e-7)


def test_bad_routing_arguments_are_rejected():
    logits = torch.zeros(2, 8, device=DEVICE)
    ids = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="scoring function"):
        moe_gate.route(logits, torch.zeros(8, device=DEVICE), None, ids, 2, "relu", True, 1.0, impl="triton")
    with pytest.raises(ValueError, match="exactly one"):
        moe_gate.route(logits, None, None, ids, 2, "sigmoid", True, 1.0, impl="triton")
    with pytest.raises(ValueError, match="cannot route to 9 of 8"):
        moe_gate.route(logits, torch.zeros(8, device=DEVICE), None, ids, 9, "sigmoid", True, 1.0, impl="triton")


@pytest.mark.parametrize("hashed", [False, True])
@pytest.mark.parametrize("T,E,D,k,scoring", [(1, 256, 512, 6, "sqrtsoftplus"), (4, 48, 300, 4, "sigmoid"),
                                             (3, 64, 128, 6, "softmax")])
def test_gate_route_matches_the_product_then_route(hashed, T, E, D, k, scoring):
    """The gate product inside the routing launch: the same experts as routing the fp32 product
    (D not a multiple of the kernel's step, E not of its programs), weights to fp32 summation
    order; the arrival counter is left at zero, so a second call on it gives the same result."""
    g = torch.Generator().manual_seed(T * E + D)
    x = torch.randn(T, D, generator=g).to(DEVICE, torch.bfloat16)
    gate = (torch.randn(E, D, generator=g) * 3 / D ** 0.5).to(DEVICE, torch.bfloat16)
    tokens = torch.randint(0, 50, (T,), generator=g).to(DEVICE)
    table = torch.randint(0, E, (50, k), generator=g, dtype=torch.int32).to(DEVICE) if hashed else None
    bias = None if hashed else (0.5 * torch.randn(E, generator=g)).to(DEVICE)
    args = (bias, table, tokens, k, scoring, True, 2.5)
    w_ref, id_ref = moe_gate.route(x.float() @ gate.float().t(), *args, impl="torch")
    arrivals = arrival_counter(DEVICE)
    w, ids = moe_gate.gate_route(x, gate, *args, arrivals)
    assert arrivals.item() == 0
    if not hashed:
        (w, ids), (w_ref, id_ref) = _sorted(w, ids), _sorted(w_ref, id_ref)
    assert torch.equal(ids, id_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
    again = moe_gate.gate_route(x, gate, *args, arrivals)
    assert torch.equal(again[0], moe_gate.gate_route(x, gate, *args, arrivals)[0])
    with pytest.raises(ValueError, match="up to 4 tokens"):
        moe_gate.gate_route(torch.cat([x] * 5), gate, *args)
