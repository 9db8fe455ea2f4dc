"""Frozen options of a worker replica, built once by the launcher and passed to each actor."""

from __future__ import annotations

from dataclasses import dataclass, field

from worker_runtime.engine_metrics import MetricsOptions
from worker_runtime.logging_setup import LogOptions

DEVICES = ("cpu", "cuda")
KERNELS = ("torch", "triton")
# "auto": the checkpoint's weights; "dummy": random weights in the device format from config.json
# alone (model/dummy_weights.py), to serve or benchmark a model whose checkpoint is not at hand
LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True)
class ExpertParallelOptions:
    """Expert parallelism of one pool (worker_runtime/ep_group.py): groups of `size` workers of the pool,
    each holding 1/size of the routed experts, stepping in lockstep."""

    size: int = 1  # workers per group; 1: every worker holds all experts
    fp8_dispatch: bool = False  # dispatch activations as e4m3 + scales (half of bf16's bytes)
    # a collective (step agreement or a MoE exchange) waiting longer than this fails the group:
    # it must exceed the longest step of any rank
    timeout_s: float = 60.0
    # how often an idle group meets anyway (a rank that gets a request wakes its peers at once):
    # what an idle group costs (one tiny all_reduce per tick), the most a request waits should a
    # wake be lost, and how late an idle rank notices a dead peer
    idle_tick_s: float = 0.5

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"expert-parallel group size must be >= 1, got {self.size}")
        if not 0 < self.idle_tick_s < self.timeout_s:
            raise ValueError(f"an expert-parallel group needs 0 < idle_tick_s < timeout_s, got idle_tick_s "
                             f"{self.idle_tick_s}, "
                             f"timeout_s {self.timeout_s}")


@dataclass(frozen=True)
class WorkerOptions:
    model_dir: str
    registry_url: str
    # the directory of the tokenizer.json the workers detokenize, match stop strings and build
    # grammars with: the router's (`--tokenizer`); "" = the checkpoint's own (model_dir)
    tokenizer_dir: str = ""
    cluster: str = "default"
    kv_dtype: str = "fp32"  # same default as `v4serve generate`, so the two agree token for token
    page_size: int = 256
    max_tokens: int = 4096  # longest request (prompt + completion) a replica accepts
    max_seqs: int = 16  # concurrent requests per replica (pool sizing)
    threads: int = 1  # torch intra-op threads per replica
    prefill_token_budget: int = 1024
    # a prefill worker writes the last chunk of a prompt into its decode target every this many
    # model layers as the forward computes them (prefill_worker/layer_stream.py); 0: whole pages
    # once the step is over
    prefill_layer_stream: int = 1
    lease_s: float = 30.0  # how long a decode reservation waits for its KV
    prefix_cache: bool = True  # prefill workers keep finished prompts' pages for reuse
    heartbeat_s: float = 1.0
    # a decode worker aborts the requests of a router whose registry lease has been gone this
    # long (a crashed router; see decode_worker/router_leases.py): longer than a Redis restart
    router_grace_s: float = 6.0
    # where the replica runs: "cpu" (the reference model, float weights), or "cuda" (the GPU Ray
    # gave the actor, cuda:0 inside it; the device format: FP8 projections, packed FP4 experts,
    # bf16 activations)
    device: str = "cpu"
    kernels: str = "torch"  # "torch" reference ops, or the "triton" kernels (model/kernels/)
    load_format: str = "auto"  # LOAD_FORMATS
    # decode batch sizes captured as CUDA graphs (device "cuda" only): a decode-only step of n
    # requests replays the smallest bucket >= n; larger or mixed steps run eagerly
    decode_graphs: tuple[int, ...] = ()
    # drafts per request and decode step through the checkpoint's MTP block, verified in the same
    # step (model/speculation.py; 0: off): every worker then loads the block and pools its layer
    speculative_tokens: int = 0
    # speculate while at most this many requests decode (plain steps above: DecodeConfig's
    # speculative_max_batch); with decode_graphs, one of the buckets or above them all
    speculative_max_batch: int = 16
    # batch-invariant kernels (model/kernels/, `set_deterministic`): a request's logits are the
    # same bits whatever shares its step, and speculation is exact on the GPU too; the CPU's torch
    # reference is batch-invariant already (accepted there, changes nothing)
    deterministic: bool = False
    # a decode worker queues each decode-only step before the last one's ids reach the host
    # (decode_worker/overlap.py); off: one step at a time (the comparison's baseline)
    overlap: bool = True
    prefill_ep: ExpertParallelOptions = field(default_factory=ExpertParallelOptions)
    decode_ep: ExpertParallelOptions = field(default_factory=ExpertParallelOptions)
    logs: LogOptions = field(default_factory=LogOptions)  # level, format, the periodic stats line
    # the worker's own /metrics and /health endpoint (worker_runtime/engine_metrics.py); port None: none
    metrics: MetricsOptions = field(default_factory=lambda: MetricsOptions(port=None))

    def __post_init__(self):
        if self.prefill_layer_stream < 0:
            raise ValueError(f"prefill_layer_stream must be >= 0 (0: off), got {self.prefill_layer_stream}")
        if self.router_grace_s <= 0:
            raise ValueError(f"router_grace_s must be positive, got {self.router_grace_s}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.device == "cpu" and self.kernels == "triton":
            raise ValueError("kernels 'triton' need device 'cuda' (on CPU the model runs the torch reference ops)")
        if self.decode_graphs:
            if self.device != "cuda" or self.kernels != "triton":
                raise ValueError("decode_graphs needs device 'cuda' and kernels 'triton' (the capturable path), "
                                 f"got device {self.device!r}, kernels {self.kernels!r}")
            if any(b <= 0 for b in self.decode_graphs) or list(self.decode_graphs) != sorted(set(self.decode_graphs)):
                raise ValueError(f"decode_graphs must be increasing positive batch sizes, got {self.decode_graphs}")
        if not 0 <= self.speculative_tokens <= 3:
            raise ValueError(f"speculative_tokens must be in 0..3 (0: off), got {self.speculative_tokens}")
        if self.speculative_max_batch < 1:
            raise ValueError(f"speculative_max_batch must be >= 1, got {self.speculative_max_batch}")
        if (self.speculative_tokens and self.decode_graphs and self.speculative_max_batch < max(self.decode_graphs)
                and self.speculative_max_batch not in self.decode_graphs):
            raise ValueError(f"speculative_max_batch {self.speculative_max_batch} must be one of decode_graphs "
                             f"{self.decode_graphs} or above them all (its batches need a verify graph)")
        if self.speculative_tokens and self.decode_ep.size > 1:
            raise ValueError("speculative_tokens is not supported with an expert-parallel decode pool (decode_ep)")
        if self.deterministic and max(self.prefill_ep.size, self.decode_ep.size) > 1:
            raise ValueError("deterministic is not supported with an expert-parallel pool (prefill_ep / decode_ep): "
                             "its expert exchange adds a token's expert outputs outside the batch-invariant kernels")
        for name in ("prefill_ep", "decode_ep"):
            size = getattr(self, name).size
            if size > 1:
                from model.checkpoint import read_config  # only then: the checkpoint names the expert count

                experts = read_config(self.model_dir).n_routed_experts
                if experts % size:
                    raise ValueError(f"{name}.size {size} must divide the model's {experts} routed experts")
