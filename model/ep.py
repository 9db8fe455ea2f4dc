"""Expert parallelism for prefill: routed experts sharded over a process group, all-to-all dispatch and combine.

Rank r of an expert-parallel group of W ranks owns routed experts [r·E/W, (r+1)·E/W); the gate and
the shared expert are replicated and attention is data-parallel: every rank runs its own tokens
through the whole model, and a rank with no tokens still joins each layer's exchanges
(`idle_step`). One MoE layer (`ExpertParallelMoE.forward`):

1. route locally: T·k assignments, ordered by the rank owning their expert (stable sort);
2. counts: all_to_all_single of W per-destination counts — the one host sync, since the token
   exchange needs its split sizes on the host (NCCL and gloo alike);
3. dispatch: one all_to_all_single of byte rows [token row | local expert id]; the row is x.dtype,
   or with `fp8_dispatch` e4m3 values plus one fp32 power-of-two scale per 128 values
   (`low_precision.fp8_quantize_rows`: half the bytes of bf16, a quarter of fp32);
4. each rank runs its experts on the rows it received (one expert per row, weight 1) with the
   MoE's impl ("torch" reference or the Triton grouped path);
5. combine: all_to_all_single of the outputs back along the reversed splits, then on the source
   rank Σ_k weight · y (slot order) + shared(x), the same arithmetic as a single rank
   (`moe_grouped.combine`).

Fixed-capacity exchange (decode; `capacity` > 0, seed 000's tokens-per-rank cap): steps 2–3
and 5 become all_to_all_single calls of equal splits, each rank sending every peer a buffer of
capacity·k rows (its rows for that peer first, the rest padding with expert id n_local), so
nothing is read on the host and a decode step with its exchanges is capturable as a CUDA graph
(every rank replays the same collectives). Padding rows are skipped by the experts (the fused
kernel's spare bin, or a mask on the torch path) and never gathered back. It moves
W·capacity·k rows per layer whatever the routing; decode steps are small, so that is cheap next to
a host sync per layer. All ranks of a step must use the same capacity (`set_capacity`).

With FP8 dispatch off, EP W gives EP 1's outputs up to fp32 rounding of the expert GEMMs (a rank's
rows are batched with other ranks' rows); with it on, the dispatched activations carry e4m3's
rounding (3 mantissa bits). Transport: gloo on CPU, NCCL on GPUs (tensors on the rank's device).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from model import low_precision
from model.kernels.moe import moe_grouped
from model.kernels.moe.packed_experts import PackedExperts
from model.moe import MoE, experts_forward
from model.transformer import Transformer

FP8_DISPATCH_BLOCK = 128


class ExpertParallelMoE(nn.Module):
    """A `MoE` whose routed experts live on the ranks of `group` (this rank keeps its slice)."""

    def __init__(self, moe: MoE, group: dist.ProcessGroup | None = None, fp8_dispatch: bool = False):
        super().__init__()
        # an explicit group answers for itself: it need not be registered with torch.distributed's
        # default group (the serving workers build theirs standalone, worker_runtime/ep_group.py)
        world, rank = (dist.get_world_size(), dist.get_rank()) if group is None else (group.size(), group.rank())
        E = moe.cfg.n_routed_experts
        if E % world:
            raise ValueError(f"{E} routed experts cannot be split evenly over an expert-parallel group of {world}")
        self.cfg, self.layer, self.impl = moe.cfg, moe.layer, moe.impl
        self.group, self.fp8_dispatch = group, fp8_dispatch
        self.capacity = 0  # tokens per rank of the fixed-capacity exchange; 0: exact splits
        self.world, self.n_local = world, E // world
        self.first = rank * self.n_local
        self.gate, self.shared_experts = moe.gate, moe.shared_experts
        if moe.packed:
            self.experts: nn.ModuleList | PackedExperts = moe.experts.narrow(self.first, self.n_local)
        else:
            self.experts = nn.ModuleList(list(moe.experts)[self.first:self.first + self.n_local])

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, side: torch.cuda.Stream | None = None) -> torch.Tensor:
        """x [T, D] (T may be 0) → [T, D]; a collective: every rank of the group must call it. The
        shared expert runs in order, between the exchanges (`side`, `MoE.forward`'s, is unused)."""
        if self.capacity:
            return self._forward_capped(x, input_ids)
        T, D = x.shape
        weights, ids = self.gate(x, input_ids)
        k = ids.shape[1]
        dest = ids.reshape(-1) // self.n_local
        order = torch.argsort(dest, stable=True)
        send = torch.bincount(dest, minlength=self.world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_splits, recv_splits = send.tolist(), recv.tolist()

        local_ids = ids.reshape(-1)[order] - dest[order] * self.n_local
        payload = _pack(x[order // k], local_ids, self.fp8_dispatch)
        got = payload.new_empty(sum(recv_splits), payload.shape[1])
        dist.all_to_all_single(got, payload, recv_splits, send_splits, group=self.group)
        rows, row_ids = _unpack(got, D, x.dtype, self.fp8_dispatch)

        y_rows = experts_forward(rows, torch.ones(len(rows), 1, device=x.device), row_ids[:, None], self.experts,
                                 None, self.cfg.swiglu_limit, self.impl)
        back = y_rows.new_empty(T * k, D)
        dist.all_to_all_single(back, y_rows, send_splits, recv_splits, group=self.group)
        y = torch.empty_like(back)
        y[order] = back
        return moe_grouped.combine(y.view(T, k, D), weights, self._shared(x))

    def _forward_capped(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The fixed-capacity exchange (module docstring); T ≤ capacity."""
        T, D = x.shape
        cap = self.capacity
        if T > cap:
            raise ValueError(f"{T} tokens exceed the expert-parallel capacity of {cap} per rank")
        weights, ids = self.gate(x, input_ids)
        k = ids.shape[1]
        per_peer = cap * k
        dest = ids.reshape(-1) // self.n_local  # [T·k]
        # a row's place in its peer's buffer: how many rows before it go to the same peer
        onehot = torch.nn.functional.one_hot(dest, self.world)
        pos = onehot.cumsum(0).gather(1, dest[:, None]).squeeze(1) - 1
        slot = dest * per_peer + pos
        rows = x.new_zeros(self.world * per_peer, D)
        rows[slot] = x.repeat_interleave(k, dim=0)
        local = torch.full((self.world * per_peer,), self.n_local, dtype=torch.int32, device=x.device)
        local[slot] = (ids.reshape(-1) - dest * self.n_local).to(torch.int32)
        got, got_ids = torch.empty_like(rows), torch.empty_like(local)
        dist.all_to_all_single(got, rows, group=self.group)
        dist.all_to_all_single(got_ids, local, group=self.group)
        y_rows = self._experts_padded(got, got_ids.long())
        back = torch.empty_like(y_rows)
        dist.all_to_all_single(back, y_rows, group=self.group)
        y = back[slot].view(T, k, D)
        return moe_grouped.combine(y, weights, self._shared(x))

    def _experts_padded(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each row through its local expert (weight 1); rows with id n_local are padding: their
        outputs are left unspecified (never read). rows [N, D], ids [N] → [N, D]."""
        ones = torch.ones(len(rows), 1, device=rows.device)
        if self.impl == "triton" and isinstance(self.experts, PackedExperts):
            # the fused kernel counts ids == n_local into its spare bin, which no program computes
            return experts_forward(rows, ones, ids[:, None], self.experts, None, self.cfg.swiglu_limit,
                                   self.impl, fused=True)
        valid = ids < self.n_local  # torch path: compute the real rows only (a host sync; not captured)
        out = torch.zeros_like(rows)
        out[valid] = experts_forward(rows[valid], ones[valid], ids[valid, None], self.experts, None,
                                     self.cfg.swiglu_limit, self.impl)
        return out

    def _shared(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.shared_experts is None:
            return None
        if isinstance(self.shared_experts, PackedExperts):  # as the one expert of a k = 1 routing
            zeros = torch.zeros(len(x), 1, dtype=torch.long, device=x.device)
            return experts_forward(x, torch.ones(len(x), 1, device=x.device), zeros, self.shared_experts, None,
                                   self.cfg.swiglu_limit, self.impl)
        return self.shared_experts(x)


def _fp8_block(dim: int) -> int:
    return math.gcd(dim, FP8_DISPATCH_BLOCK)  # 128 for real widths; whole rows of a narrower test model


def _pack(rows: torch.Tensor, ids: torch.Tensor, fp8: bool) -> torch.Tensor:
    """rows [n, D], local expert ids [n] → uint8 [n, row bytes + 4]."""
    parts = []
    if fp8:
        q, scale = low_precision.fp8_quantize_rows(rows, _fp8_block(rows.shape[1]))
        parts += [q.view(torch.uint8), scale.contiguous().view(torch.uint8)]
    else:
        parts.append(rows.contiguous().view(torch.uint8))
    parts.append(ids.to(torch.int32).view(-1, 1).view(torch.uint8))
    return torch.cat(parts, dim=1)


def _unpack(payload: torch.Tensor, dim: int, dtype: torch.dtype, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `_pack` → (rows [n, D] in dtype, local expert ids [n] int64)."""
    ids = payload[:, -4:].contiguous().view(torch.int32).view(-1).long()
    if not fp8:
        return payload[:, :-4].contiguous().view(dtype), ids
    block = _fp8_block(dim)
    q = payload[:, :dim].contiguous().view(torch.float8_e4m3fn)
    scale = payload[:, dim:-4].contiguous().view(torch.float32)
    return low_precision.fp8_dequantize_rows(q, scale, block).to(dtype), ids


# ---------------------------------------------------------------------------------------
# whole model
# ---------------------------------------------------------------------------------------

def shard_experts(model: Transformer, group: dist.ProcessGroup | None = None, fp8_dispatch: bool = False
                  ) -> Transformer:
    """Replace every block's MoE (MTP block included) by its expert-parallel form, in place."""
    for block in [*model.layers, *model.mtp]:
        if not isinstance(block.ffn, MoE):
            raise ValueError(f"layer {block.ffn.layer}'s ffn is already expert-parallel")
        block.ffn = ExpertParallelMoE(block.ffn, group, fp8_dispatch)
    return model


def set_capacity(model: Transformer, tokens_per_rank: int) -> None:
    """Use the fixed-capacity exchange (decode steps of at most `tokens_per_rank` tokens on every
    rank) or, with 0, the exact-split one; every rank must set the same value for a step."""
    for block in [*model.layers, *model.mtp]:
        if isinstance(block.ffn, ExpertParallelMoE):
            block.ffn.capacity = tokens_per_rank


@torch.no_grad()
def idle_step(model: Transformer, with_mtp: bool = False) -> None:
    """A rank with no tokens this step: join every MoE layer's exchanges with zero rows, in the
    order a forward (then `forward_mtp` if `with_mtp`) visits them, so the other ranks' steps complete."""
    blocks = [*model.layers, *(model.mtp if with_mtp else [])]
    device = model.embed.weight.device
    x = torch.empty(0, model.cfg.hidden_size, dtype=model.embed.weight.dtype, device=device)
    ids = torch.empty(0, dtype=torch.long, device=device)
    for block in blocks:
        if not isinstance(block.ffn, ExpertParallelMoE):
            raise ValueError("idle_step needs a model whose experts were sharded with shard_experts")
        block.ffn(x, ids)
