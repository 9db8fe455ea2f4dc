"""Batch-invariant reference ops: on the CPU, each output element of these ops is a function of the
input values it reads and of nothing else: not of the tensor's shape, the other rows of a batch,
where in the tensor an element lies, the thread count or the machine's load. The torch reference
path (impl "torch", which the CPU serves and every test runs) computes its products, reductions,
softmaxes, activations and top-k through them; that is what makes a request's logits the same
bits alone, batched, chunked or resumed elsewhere (invariant 1 of ARCHITECTURE.md; docs/model.md,
"Batch invariance").

Why plain torch is not enough on the CPU (each measured with this torch and its MKL):
* BLAS chooses its kernel and its K blocking by the matrix shape and splits K over threads: a row
  of x·Wᵀ differs in its last bits at M = 1, 2, 3 or 670 rows, and at 1 or 2 threads for long K.
* torch's vectorised sigmoid, SiLU, softplus and exp2 compute the bulk of a tensor and its tail
  with different code: an element's last bit depends on where it lies.
* torch's sum and softmax order a row's additions by the row's length and the vector width.

The ops:
* `dot`, `mix`, `matmul`, `linear`: exact sums. Each row of a (along K) and each row of the other
  operand (`Rows`: a weight's output rows, an attention's keys) become fixed-point integers, some
  bits below the binade of their largest element, held in float64 and multiplied by BLAS: every
  partial sum is an integer below 2^53, so every sum is exact whatever its blocking, order or
  thread split, and is then scaled back and rounded once to float32. The 53 bits are split between
  the operands less ⌈log2 K⌉ (`fixed_point_bits`: 23 at K = 64, 20 at K = 4096): each element
  is within 2^-bits of its row's largest, about float32's own rounding, and zeros anywhere in a
  row (masked entries, and padding up to a stated `k_max`) change nothing. Off the CPU: torch's
  float matmul.
* `sum`, `mean`: pairwise over the reduced dim, zero-padded to a power of two (each step adds the
  second half onto the first): the order of the additions is a function of the index alone, and
  zeros appended at the end leave the result's bits unchanged.
* `softmax`: max, exp, `sum`, divide.
* `sigmoid`, `silu`, `softplus`: from exp, log1p and division, which torch computes alike
  everywhere.
* `top_k`: the one tie-break rule of every top-k (the indexer's, the MoE gate's): larger values
  first, and among equal values (−0 equal to +0) the lower index first.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


# ---------------------------------------------------------------------------------------
# products
# ---------------------------------------------------------------------------------------

# Fixed-point products are exact in float64 while every partial sum stays within 53 bits
EXACT_BITS = 53


def fixed_point_bits(k: int) -> int:
    """Bits below each row's largest binade that `Rows.of` keeps for rows of length k: half of
    what sums of k products may take and stay exact in float64."""
    return (EXACT_BITS - _log2_ceil(k)) // 2


def _log2_ceil(k: int) -> int:
    return builtins.max(k - 1, 0).bit_length()


# exponent bias and range of the two float formats the scales are built in
_FORMATS = {torch.float32: (torch.int32, 23, 127, 127), torch.float64: (torch.int64, 52, 1023, 1023)}


def _scale(e: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """2^(bits - e) in `dtype`, exact, made from its bits (torch's pow, exp2 and ldexp go through
    vectorised code that need not be exact); capped at the format's largest power of two, which
    only a slice of denormals reaches (it then keeps fewer bits, the same ones every time)."""
    int_type, mantissa, bias, top = _FORMATS[dtype]
    return (((bias + bits) - e.to(int_type)).clamp(1, bias + top) << mantissa).view(dtype)


def _fixed(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x → (q, s) with x ≈ q / s: q integers in float64, |q| ≤ 2^bits, rounded half to even; s a
    power of two per slice along `dim` (kept as size 1), the slice's largest |x| below 2^bits / s.
    float32 x (or narrower) is scaled and rounded in float32, float64 in float64: exact either way
    (a power of two scales exactly, and a float at or above 2^23 is an integer already)."""
    x = x if x.dtype == torch.float64 else x.float()
    e = torch.frexp(x.abs().amax(dim, keepdim=True)).exponent
    s = _scale(e, bits, x.dtype)
    return (x * s).round().double(), s


@dataclass(frozen=True)
class Rows:
    """The rows [..., L, K] of a float matrix as `dot` and `mix` take them: on the CPU each row as
    fixed-point integers q with a power-of-two scale of its own (row ≈ q / s), elsewhere the float
    rows as they are. Made once, gathered (`take`) and masked as often as needed: an attention's
    keys are quantised once a segment, a weight once (`weight_rows`)."""
    q: torch.Tensor  # float64 integers [..., L, K] (CPU) or float32
    s: torch.Tensor | None  # float32 [..., L, 1] (CPU)
    bits: int

    @classmethod
    def of(cls, x: torch.Tensor) -> "Rows":
        if x.device.type != "cpu":
            return cls(x.float(), None, 0)
        bits = fixed_point_bits(x.shape[-1])
        return cls(*_fixed(x, -1, bits), bits)

    def take(self, index) -> "Rows":
        """The rows at `index` (an index of the leading dims, as for a tensor)."""
        return Rows(self.q[index], None if self.s is None else self.s[index], self.bits)

    def masked(self, keep: torch.Tensor) -> "Rows":
        """Rows where `keep` [..., L] is False set to zero."""
        return Rows(self.q.masked_fill(~keep.unsqueeze(-1), 0), self.s, self.bits)


def weight_rows(w: torch.Tensor) -> Rows:
    """`Rows.of(w)` for a weight, kept on the tensor for as long as its values are those quantised
    (its version counter and storage unchanged): products quantise their inputs, not the weight."""
    key = (w._version, w.data_ptr(), w.dtype, tuple(w.shape))
    cached = getattr(w, "_invariant_rows", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    rows = Rows.of(w)
    w._invariant_rows = (key, rows)
    return rows


def dot(a: torch.Tensor, rows: Rows) -> torch.Tensor:
    """a [..., M, K] · rowsᵀ → float32 [..., M, L] (batch dims broadcast): element (m, l) is the
    exact dot product of row m of a with row l, rounded once (module docstring); it depends on
    those two rows alone. Inputs must be finite."""
    if rows.s is None:
        return torch.matmul(a.float(), rows.q.transpose(-1, -2))
    qa, sa = _fixed(a, -1, EXACT_BITS - rows.bits - _log2_ceil(a.shape[-1]))
    return (torch.matmul(qa, rows.q.transpose(-1, -2)) / sa / rows.s.transpose(-1, -2)).float()


def mix(p: torch.Tensor, rows: Rows, k_max: int | None = None) -> torch.Tensor:
    """p [..., M, L] · rows → float32 [..., M, K]: Σ_l p[m, l] · row l, exact, rounded once; element
    (m, k) depends on row m of p and the rows its nonzero weights name, whatever else `rows`
    holds. `k_max`: where L varies with the batch (rows padded to the batch's widest), the most
    rows a p row can weigh: the bits follow it instead of L, so every padding gives the same
    bits."""
    if rows.s is None:
        return torch.matmul(p.float(), rows.q)
    # p · rows = (p with each weight divided by its row's scale) · the rows' integers, exact in
    # float64 (a float32 scale ratio may not be)
    scaled = p.double() / rows.s.transpose(-1, -2)
    qa, sa = _fixed(scaled, -1, EXACT_BITS - rows.bits - _log2_ceil(builtins.max(p.shape[-1], k_max or 0)))
    return (torch.matmul(qa, rows.q) / sa).float()


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] · b [..., K, N] → float32 [..., M, N] (`dot` with b's columns as the rows)."""
    return dot(a, Rows.of(b.transpose(-1, -2)))


def linear(x: torch.Tensor, weight: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
    """x [..., K] · weight [N, K]ᵀ → [..., N] in x's dtype (`dot`; F.linear off the CPU, or with
    `deterministic` the fixed-tile kernel, whose rows do not depend on the batch either)."""
    if x.device.type != "cpu":
        if deterministic:
            from model.kernels.gemm import fixed_matmul  # Triton: only off the CPU

            return fixed_matmul.linear(x, weight.to(x.dtype))
        return F.linear(x, weight)
    return dot(x, weight_rows(weight)).to(x.dtype)


class Linear(nn.Linear):
    """`nn.Linear` without bias whose product is `linear`: the model's float projections (same
    parameter names, so checkpoints load as they did; `quantize_model` still takes it for one)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.deterministic = False  # `kernels.set_deterministic`: the fixed-tile product off the CPU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.deterministic)


# ---------------------------------------------------------------------------------------
# reductions
# ---------------------------------------------------------------------------------------

def sum(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Σ along `dim`, pairwise in a fixed order (module docstring). The padding is −0.0, the one
    value whose addition changes no bit of anything."""
    dim = dim % x.dim()
    n = x.shape[dim]
    if n == 0:
        return x.sum(dim, keepdim=keepdim)
    width = 1 << (n - 1).bit_length()
    if width != n:
        shape = list(x.shape)
        shape[dim] = width - n
        x = torch.cat([x, x.new_full(shape, -0.0)], dim)
    while width > 1:
        width //= 2
        x = x.narrow(dim, 0, width) + x.narrow(dim, width, width)
    return x if keepdim else x.squeeze(dim)


def mean(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    return sum(x, dim, keepdim) / x.shape[dim]


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """softmax along `dim` (a slice of only -inf gives NaN, as torch's does)."""
    e = torch.exp(x - x.amax(dim, keepdim=True))
    return e / sum(e, dim, keepdim=True)


# ---------------------------------------------------------------------------------------
# activations
# ---------------------------------------------------------------------------------------

def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e^x), x itself above 20 (torch's threshold)."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x.clamp(max=20.0))))


# ---------------------------------------------------------------------------------------
# top-k
# ---------------------------------------------------------------------------------------

def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest along the last dim → (values, indices [..., k] int64), largest first; among
    equal values (−0 equal to +0) the lower index first. torch.topk leaves the choice among ties
    and their order to its implementation, which differs with the row's shape (and the device);
    a stable sort does not. Every top-k of the model, reference or kernel, picks by this rule."""
    k = builtins.min(k, x.shape[-1])
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]
