"""One worker's model replica: the checkpoint on the worker's device, in the weight format and
kernels its options name, over the KV pools it serves from.

    device "cpu":  float32 weights, the torch reference ops (the path every oracle test uses)
    device "cuda": the device format (FP8 block-scaled projections, packed FP4 experts, bf16
                   activations; `model/quantized.py`) through `kernels` ("triton" or the torch
                   reference ops), optionally with CUDA graphs for decode steps; the FP8
                   projections quantise their inputs too where the checkpoint says so
                   (`activation_scheme` "dynamic", W8A8)

With load format "dummy" the replica is random device-format weights built from config.json
(`model/dummy_weights.py`), on either device; in an expert-parallel pool its routed experts wait
as shapes until the group has given this rank its slice (`worker_runtime/ep_group.py`).

Inside a Ray actor "cuda" is cuda:0: Ray sets CUDA_VISIBLE_DEVICES to the GPUs the actor asked
for (`--gpus-per-worker`).
"""

from __future__ import annotations

import logging
import sys

import torch

from model.batch import ForwardBatch
from model.checkpoint import fp8_activations, load_checkpoint, read_config
from model.config import ModelConfig
from model.cuda_graph import DecodeGraph
from model.dummy_weights import dummy_model
from model.ep import set_capacity
from model.kernels import set_deterministic
from model.kv_pool import KVPools, SeqKV
from model.quantized import quantize_model
from model.transformer import Transformer
from worker_runtime.logging_setup import load_progress
from worker_runtime.options import WorkerOptions
from worker_runtime.wire import ErrorCode, ErrorInfo

log = logging.getLogger(__name__)
MEMORY_FLAGS = "lower --max-seqs or --max-model-len (the pools) or --prefill-token-budget (the step)"


def load_replica(options: WorkerOptions, expert_parallel: bool = False
                 ) -> tuple[ModelConfig, Transformer, KVPools]:
    """(config, model, pools) of one worker. The pools hold `max_seqs` requests of `max_tokens`,
    plus one when decode graphs are captured (their padding rows decode a scratch request).
    `expert_parallel`: the worker is a rank of an expert-parallel group (dummy weights then defer
    the routed experts to the group's sharding). With `speculative_tokens` the model has its MTP
    block and the pools its layer, on prefill and decode workers alike (pages match only so).
    Loading reports its progress as `options.logs` says (`logging_setup.load_progress`)."""
    if options.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' but this worker sees no CUDA GPU: give each worker one "
                           "(--gpus-per-worker 1) on a node that has them")
    with_mtp = options.speculative_tokens > 0
    progress = load_progress(options.logs, label=_actor_name())
    if options.load_format == "dummy":
        cfg = read_config(options.model_dir)
        model = dummy_model(cfg, options.kernels, options.device, fp8_activations(options.model_dir),
                            defer_experts=expert_parallel, with_mtp=with_mtp, progress=progress)
    else:
        cfg, model = load_checkpoint(options.model_dir, device=options.device, with_mtp=with_mtp, progress=progress)
        if options.device == "cuda":
            quantize_model(model, options.kernels, act_fp8=fp8_activations(options.model_dir))
    if with_mtp and options.device == "cuda":  # drafts read an FP8 head (a proposal's precision moves no token)
        model.quantize_draft_head()
    set_deterministic(model, options.deterministic)  # after quantize_model, which makes new modules
    pools = KVPools(cfg, options.kv_dtype, page_size=options.page_size, max_tokens=options.max_tokens,
                    max_seqs=options.max_seqs + (1 if options.decode_graphs else 0), device=options.device,
                    with_mtp=with_mtp)
    return cfg, model, pools


def check_step_fits(model: Transformer, pools: KVPools, tokens: int, what: str) -> None:
    """Run one eager step of `tokens` prompt tokens (a worker's largest step) on a scratch request,
    once at start on a GPU: a worker whose weights, KV pools and graphs leave too little memory
    for that step then fails to start, naming the flags to change, instead of failing every
    running request when load first brings such a step. The step's activations stay in torch's
    cache for the steps that follow. Does nothing off the GPU (the pools' device), where memory
    is the host's."""
    if torch.device(pools.device).type != "cuda":
        return
    seq = SeqKV()
    pools.reserve(seq, tokens)
    try:
        model(ForwardBatch.build([(seq, [0] * tokens)], pools.device), pools)
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        free, total = torch.cuda.mem_get_info()
        held = torch.cuda.memory_allocated() / 2**30
        raise RuntimeError(
            f"{what} = {tokens} tokens in one step does not fit in GPU memory beside the weights, the KV pools "
            f"and the decode graphs ({held:.1f} GiB held, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free): "
            f"{MEMORY_FLAGS}") from None
    finally:
        pools.release(seq)
    # what is left is all the room later allocations have (NIXL's and NCCL's buffers, the
    # allocator's fragmentation): an operator reading a small figure here lowers the flags above
    free, total = torch.cuda.mem_get_info()
    log.info("%s%s = %d tokens in one step fits, leaving %.1f of %.1f GiB free", _prefix(), what, tokens,
             free / 2**30, total / 2**30)


def step_error(kind: str, e: Exception) -> ErrorInfo:
    """What the requests of a `kind` worker's step that raised `e` are told. Out of GPU memory, the
    allocator's cached blocks are handed back too, so the next steps start from unfragmented memory
    (the step's own tensors are freed with its frames)."""
    if isinstance(e, torch.OutOfMemoryError):
        torch.cuda.empty_cache()
        return ErrorInfo(ErrorCode.INTERNAL, f"{kind} worker ran out of GPU memory in a step: {MEMORY_FLAGS}")
    return ErrorInfo(ErrorCode.INTERNAL, f"{kind} worker error")


def _prefix() -> str:
    name = _actor_name()
    return f"{name}: " if name else ""


def _actor_name() -> str:
    """The name of the Ray actor this runs in (the launcher names workers by id: `decode-0`), else
    "". Ray prefixes an actor's lines with its repr, the worker id, only once it is constructed:
    while it loads its weights, with its class name, which does not tell two workers apart."""
    ray = sys.modules.get("ray")  # a process that never imported Ray runs in no actor
    if ray is None or not ray.is_initialized():  # (get_runtime_context would start a Ray instance)
        return ""
    return ray.get_runtime_context().get_actor_name() or ""


class DecodeGraphs:
    """The CUDA graphs of a decode worker, one per batch-size bucket, sharing one scratch request
    (the pages their padding rows write). Captured once at start, before any request.

    In an expert-parallel group (`expert_parallel`) every rank captures every bucket at once (the
    captures' collectives pair up), each with the fixed-capacity exchange of that bucket's size
    (`model.ep.set_capacity`); eager steps then use the exact-split exchange again. A rank with no
    request replays the agreed bucket's graph on padding rows alone, so its exchanges match."""

    def __init__(self, model: Transformer, pools: KVPools, buckets: tuple[int, ...], max_context: int,
                 expert_parallel: bool = False, tokens_per_row: int = 1, verify_max_rows: int | None = None):
        """`tokens_per_row` L > 1: the buckets up to `verify_max_rows` (all by default; it must be
        one of them or above them all) capture verify steps of L tokens a request and a draft step
        each, the larger ones plain steps of one token: the engine speculates in batches up to
        there only (`DecodeConfig.speculative_max_batch`)."""
        if tokens_per_row == 1:
            verify_max_rows = 0
        elif verify_max_rows is None:
            verify_max_rows = max(buckets, default=0)
        elif verify_max_rows < max(buckets, default=0) and verify_max_rows not in buckets:
            raise ValueError(f"the speculative batch limit {verify_max_rows} must be one of the graph buckets "
                             f"{buckets} or above them all (a batch under it would find no verify graph)")
        # a verify row writes up to tokens_per_row - 1 positions past its request's last token, a
        # step queued ahead one; a verify step queued ahead is placed as if every draft of the one
        # before was kept, up to 2·tokens_per_row past (`DecodeEngine.tokens_held`)
        max_context += 2 * tokens_per_row if tokens_per_row > 1 else 1
        self.scratch = SeqKV()
        pools.reserve(self.scratch, max_context)
        self.graphs = []
        for b in buckets:
            if expert_parallel:
                set_capacity(model, b)
            self.graphs.append(DecodeGraph(model, pools, b, max_context, scratch=self.scratch,
                                           tokens_per_row=tokens_per_row if b <= verify_max_rows else 1))
        if expert_parallel:
            set_capacity(model, 0)
        # with speculation, the draft step of each bucket (the MTP block at one token a row), and
        # its chain of N drafts drawn in the graph, for steps whose sampling needs nothing from
        # the host (`speculation.draft(on_device=True)`)
        drafting = [b for b in buckets if b <= verify_max_rows] if tokens_per_row > 1 else []
        self.drafts = [DecodeGraph(model, pools, b, max_context, scratch=self.scratch, draft=True) for b in drafting]
        self.chains = [DecodeGraph(model, pools, b, max_context, scratch=self.scratch, draft=True,
                                   chain=tokens_per_row - 1) for b in drafting]
        self.tokens_per_row = tokens_per_row  # > 1: speculative verify steps of that many tokens a request
        self.verify_max_rows = verify_max_rows  # the largest batch captured as verify steps
        self.replays = 0  # decode steps served by a graph (counted by the engine that replays them)

    def for_batch(self, batch) -> DecodeGraph | None:
        """The smallest graph that runs `batch`, or None (a prefill chunk in it, segments of unequal
        length or of no captured length, or too many rows)."""
        segs = batch.segments
        if not segs or any(s.length != segs[0].length for s in segs):
            return None
        return next((g for g in self.graphs if g.L == segs[0].length and g.B >= len(segs)), None)

    def for_rows(self, rows: int) -> DecodeGraph | None:
        """The smallest graph of at least `rows` rows, or None."""
        return next((g for g in self.graphs if g.B >= rows), None)

    def draft_for_rows(self, rows: int) -> DecodeGraph | None:
        """The smallest draft graph of at least `rows` rows, or None (no speculation, too many rows)."""
        return next((g for g in self.drafts if g.B >= rows), None)

    def chain_for_rows(self, rows: int) -> DecodeGraph | None:
        """The smallest chain graph (`DecodeGraph.run_chain`) of at least `rows` rows, or None."""
        return next((g for g in self.chains if g.B >= rows), None)

    def held_pages(self) -> dict[str, int]:
        """Pages the scratch request holds for good (not free when the worker is idle)."""
        return {k: sum(1 for p in pages if p >= 0) for k, pages in self.scratch.pages.items()}
