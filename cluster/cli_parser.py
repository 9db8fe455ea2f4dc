"""The `v4serve` command line's parser: every command, flag, default and help text (`--help`
shows the defaults), and the argument types that refuse bad values with one line."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from model.kv_pool import STORAGE_FORMATS
from worker_runtime.logging_setup import FORMATS, LEVELS
from worker_runtime.options import DEVICES, KERNELS, LOAD_FORMATS


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _batch_sizes(text: str) -> tuple[int, ...]:
    if text.strip().lower() == "none":
        return ()
    try:
        sizes = tuple(sorted({int(t) for t in text.split(",") if t.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes, got {text!r}") from None
    if any(b < 1 for b in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be positive, got {text!r}")
    return sizes


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default, except where there is none to show (unset, off, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, [], ()) or action.default is argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("v4serve")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="v4serve", description="DeepSeek-V4 disaggregated serving",
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"v4serve {_version()}")
    logs = argparse.ArgumentParser(add_help=False)  # what every command takes
    logs.add_argument("--log-level", choices=LEVELS, default="info",
                      help="log records from this level on (workers too); debug adds tracebacks to errors")
    logs.add_argument("--log-format", choices=FORMATS, default="text", help="json: one JSON object per line")
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny", parents=[logs], help="write a small random V4 checkpoint")
    tiny.add_argument("--out", required=True, type=Path, help="directory to write")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    tiny.add_argument("--format", choices=("official", "hf"), default="official", help="checkpoint layout")

    conf = sub.add_parser("make-config", parents=[logs],
                          help="write a model's config.json alone (for --load-format dummy)")
    conf.add_argument("--out", required=True, type=Path)
    conf.add_argument("--preset", choices=("v4-flash",), default="v4-flash",
                      help="v4-flash: DeepSeek-V4-Flash's shapes (43 layers, hidden 4096, 256 experts top-6)")
    conf.add_argument("--layers", type=_positive, default=None, help="keep the first N layers (default: all)")

    gen = sub.add_parser("generate", parents=[logs], help="run one request in this process")
    gen.add_argument("--model", required=True, type=Path, help="checkpoint directory")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", type=_token_ids, help="comma-separated token ids")
    gen.add_argument("--max-new-tokens", type=_positive, required=True)
    gen.add_argument("--temperature", type=float, default=None,
                     help="0: greedy (default: the checkpoint's generation_config.json, else 1.0)")
    gen.add_argument("--top-p", type=float, default=None,
                     help="nucleus sampling mass (default: generation_config.json, else 1.0)")
    gen.add_argument("--top-k", type=int, default=None, help="0: no top-k cut (default: generation_config.json, else 0)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.add_argument("--kv-dtype", choices=STORAGE_FORMATS, default="fp32", help="KV cache storage format")
    gen.add_argument("--chunk-size", type=_positive, default=None, help="prefill the prompt in chunks of N tokens")
    gen.add_argument("--speculative-tokens", type=int, choices=range(4), default=0, metavar="{0..3}",
                     help="draft N tokens per step with the checkpoint's MTP block and verify them in one step "
                          "(the tokens are those of N = 0, the default)")
    gen.add_argument("--deterministic", action="store_true",
                     help="batch-invariant kernels: a request's logits the same bits whatever the batch, chunking or "
                          "speculation depth (the CPU's reference ops are so already: accepted, changes nothing)")
    gen.add_argument("--logits-out", type=Path, default=None, help="save float32 [new_tokens, vocab] .npy")

    serving = argparse.ArgumentParser(add_help=False, parents=[logs])  # what `up` and `router` share
    serving.add_argument("--model", default="tiny", help="checkpoint directory, or 'tiny' (created once, cached)")
    serving.add_argument("--cluster", type=_cluster_name, default="default",
                         help="name of the pools: their registry key prefix and Ray namespace")
    serving.add_argument("--host", default="127.0.0.1", help="address the HTTP and gRPC servers listen on")
    serving.add_argument("--http-port", type=_port, default=8000, help="OpenAI HTTP API and /metrics (0: any free)")
    serving.add_argument("--grpc-port", type=_port, default=50051, help="gRPC API (0: any free)")
    serving.add_argument("--max-model-len", type=_positive, default=4096, help="longest prompt + completion")
    serving.add_argument("--remote-prefill-threshold", type=int, default=0,
                         help="uncached prompt tokens from which a prefill worker is used")
    serving.add_argument("--served-model-name", action="append", default=[],
                         help="a name clients use in `model` (repeatable; the first is reported; default: the "
                              "checkpoint's _name_or_path or directory name; 'v4serve' is always accepted)")
    serving.add_argument("--tokenizer", type=Path, default=None,
                         help="the tokenizer.json (a file or its directory) the router and the workers use "
                              "instead of the checkpoint's")
    serving.add_argument("--api-key", action="append", default=[], help="require this API key (repeatable)")
    serving.add_argument("--api-key-file", type=Path, default=None,
                         help="file with one API key per line (keeps keys out of the command line)")
    serving.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate: HTTPS and gRPC over TLS")
    serving.add_argument("--tls-key", type=Path, default=None, help="PEM private key for --tls-cert")
    serving.add_argument("--access-log", action="store_true", help="log one line per HTTP request (method, path, "
                                                                   "status, client) and per gRPC call (method, status, "
                                                                   "duration, request id, peer)")

    up = sub.add_parser("up", parents=[serving],
                        help="start the pools (and Ray, Redis unless RAY_ADDRESS, REDIS_URL name them) and "
                             "serve them until SIGINT/SIGTERM")
    up.add_argument("--prefill", type=_nonnegative, default=1,
                    help="prefill workers (0: decode workers prefill); with --prefill-ep N, a multiple of N")
    up.add_argument("--prefill-ep", type=_positive, default=1,
                    help="expert-parallel prefill: the prefill workers form groups of N that step in lockstep, "
                         "each holding 1/N of the routed experts (N divides the expert count)")
    up.add_argument("--prefill-ep-fp8-dispatch", action="store_true",
                    help="send the expert-parallel dispatch as FP8 (e4m3 + scales): fewer bytes, rounded activations")
    up.add_argument("--prefill-ep-timeout", type=float, default=60.0,
                    help="seconds an expert-parallel collective may wait (a peer's longest step) before the "
                         "group is declared failed")
    up.add_argument("--decode", type=_positive, default=1, help="decode workers; with --decode-ep N, a multiple of N")
    up.add_argument("--decode-ep", type=_positive, default=1,
                    help="expert-parallel decode: the decode workers form groups of N that step in lockstep, "
                         "each holding 1/N of the routed experts")
    up.add_argument("--decode-ep-timeout", type=float, default=60.0,
                    help="seconds an expert-parallel decode collective may wait before the group is declared failed")
    up.add_argument("--kv-dtype", choices=STORAGE_FORMATS, default="fp32", help="KV cache storage format")
    up.add_argument("--max-seqs", type=_positive, default=16, help="concurrent requests per worker")
    up.add_argument("--prefill-token-budget", type=_positive, default=1024,
                    help="prompt tokens a worker prefills per step (the chunk size; a longer prompt takes several)")
    up.add_argument("--gpus-per-worker", type=float, default=0.0, help="GPUs each worker actor requests")
    up.add_argument("--device", choices=DEVICES, default="cpu",
                    help="cuda: each worker serves from its GPU in the device format (needs --gpus-per-worker)")
    up.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                    help="dummy: random weights from the model's config.json alone (benchmarks)")
    up.add_argument("--kernels", choices=KERNELS, default=None,
                    help="model ops (default: triton on cuda, torch on cpu)")
    up.add_argument("--speculative-tokens", type=int, choices=range(4), default=0, metavar="{0..3}",
                    help="decode workers draft N tokens per request and step with the MTP block and verify them "
                         "in the step (the tokens are those of N = 0, the default; --decode-graphs then capture "
                         "verify steps of N+1 tokens a request)")
    up.add_argument("--speculative-max-batch", type=int, default=16, metavar="N",
                    help="speculate while at most N requests decode on a worker, plain steps above (default 16; "
                         "with --decode-graphs one of the buckets)")
    up.add_argument("--no-overlap", action="store_true",
                    help="decode workers take one step at a time instead of queuing each decode-only step before "
                         "the last one's tokens reach the host (docs/gpu.md, overlapped decode steps)")
    up.add_argument("--deterministic", action="store_true",
                    help="batch-invariant GPU kernels: a request's logits are the same bits whatever shares its "
                         "batch, its chunking or speculation depth (slower; docs/gpu.md; the CPU is so already)")
    up.add_argument("--decode-graphs", type=_batch_sizes, default=None,
                    help="decode batch sizes captured as CUDA graphs, e.g. 1,8,32,64 "
                         "(default on cuda with triton: 1,2,4,8,16,32,64 up to --max-seqs; 'none': eager)")
    up.add_argument("--start-timeout", type=_positive, default=120,
                    help="seconds the workers may take to be placed, load their weights and register; then "
                         "exit 1 with the reason")
    up.add_argument("--stats-interval", type=_seconds, default=10.0,
                    help="seconds between each worker's stats line (running, waiting, KV use, tokens/s); 0: none")
    up.add_argument("--worker-metrics-port", type=_port, default=0,
                    help="each worker serves /metrics and /health on the first free port from this one (0: any "
                         "free port; the launcher logs each worker's URL)")
    up.add_argument("--engine-stall-timeout", type=_positive, default=600,
                    help="a worker's /health fails once one model step has run this many seconds (a wedged "
                         "engine; the chart's liveness probe restarts it)")
    up.add_argument("--autoscale", choices=("off", "policy", "follow"), default="off",
                    help="policy: grow/shrink the pools on queue depth; follow: one worker per Ray "
                         "prefill/decode resource unit (pods scaled from outside, e.g. KEDA)")
    up.add_argument("--autoscale-config", type=Path, default=None, help="JSON AutoscalerConfig for --autoscale policy")
    up.add_argument("--prefill-resources", type=_resources, default=(), metavar="NAME=N[,NAME=N]",
                    help="Ray custom resources each prefill worker requests besides `prefill`: pins the pool to "
                         "the nodes started with them, e.g. v4serve_prefill=1")
    up.add_argument("--decode-resources", type=_resources, default=(), metavar="NAME=N[,NAME=N]",
                    help="the same for decode workers, e.g. v4serve_decode=1")

    sub.add_parser("router", parents=[serving],
                   help="serve the pools a `v4serve up` owns (joins RAY_ADDRESS and REDIS_URL) until "
                        "SIGINT/SIGTERM; any number may run")
    drain = sub.add_parser("drain", parents=[logs], help="drain a worker of a running cluster: routers stop choosing it; a decode "
                                         "worker migrates its running requests to the others, a prefill worker "
                                         "finishes its work; prints the result once it is idle")
    drain.add_argument("worker", help="worker id, e.g. decode-1")
    drain.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, else this node's cluster)")
    drain.add_argument("--namespace", default=None, help="Ray namespace of the cluster (when several share a Ray)")
    drain.add_argument("--no-migrate", action="store_true", help="decode: let running requests finish in place")
    drain.add_argument("--settle", type=float, default=2.0, help="seconds it must stay idle")
    drain.add_argument("--timeout", type=float, default=None, help="give up after this many seconds (exit 1)")
    for command in sub.choices.values():
        command.formatter_class = _HelpFormatter
    return parser


def _nonnegative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {value}")
    return value


def _cluster_name(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", text):
        raise argparse.ArgumentTypeError(f"cluster name must be 1-63 of A-Z a-z 0-9 _ . - (starting with a letter "
                                         f"or digit), got {text!r}")
    return text


def _resources(text: str) -> tuple[tuple[str, float], ...]:
    """NAME=N[,NAME=N] → ((NAME, N), ...): Ray custom resources, N > 0."""
    out = {}
    for item in (t.strip() for t in text.split(",") if t.strip()):
        name, eq, amount = item.partition("=")
        try:
            value = float(amount)
        except ValueError:
            value = 0.0
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", name) or not value > 0:
            raise argparse.ArgumentTypeError(f"expected NAME=N[,NAME=N] with N > 0 (Ray custom resources), got "
                                             f"{item!r}")
        if name in out:
            raise argparse.ArgumentTypeError(f"resource {name!r} given twice")
        out[name] = value
    if not out:
        raise argparse.ArgumentTypeError(f"expected NAME=N[,NAME=N], got {text!r}")
    return tuple(out.items())
