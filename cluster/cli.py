"""`v4serve` command line: make-tiny, make-config, generate, up (own the pools and serve them),
router (serve pools owned elsewhere), drain (empty a worker of a running cluster).

Arguments are parsed and validated here, turned into frozen option objects once, and passed
explicitly; bad input prints one line `error: ...` on stderr and exits with status 2. A start-up
that fails (a port in use, a worker that cannot be placed or whose checkpoint is bad) prints one
line `error: ...` and exits with status 1; `--log-level debug` adds the traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

from model.kv_pool import STORAGE_FORMATS
from worker_runtime.logging_setup import FORMATS, LEVELS, LogOptions, configure
from worker_runtime.options import DEVICES, KERNELS, LOAD_FORMATS


class CliError(Exception):
    """A user error: reported as one line, exit status 2."""


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
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="0: no top-k cut")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.add_argument("--kv-dtype", choices=STORAGE_FORMATS, default="fp32", help="KV cache storage format")
    gen.add_argument("--chunk-size", type=_positive, default=None, help="prefill the prompt in chunks of N tokens")
    gen.add_argument("--speculative-tokens", type=int, choices=range(4), default=0, metavar="{0..3}",
                     help="draft N tokens per step with the checkpoint's MTP block and verify them in one step "
                          "(the tokens are those of N = 0, the default)")
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
                         help="the router's tokenizer.json (a file or its directory) instead of the checkpoint's")
    serving.add_argument("--api-key", action="append", default=[], help="require this API key (repeatable)")
    serving.add_argument("--api-key-file", type=Path, default=None,
                         help="file with one API key per line (keeps keys out of the command line)")
    serving.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate: HTTPS and gRPC over TLS")
    serving.add_argument("--tls-key", type=Path, default=None, help="PEM private key for --tls-cert")
    serving.add_argument("--access-log", action="store_true", help="log one line per HTTP request (method, path, "
                                                                   "status, client)")

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
                         "in the step (the tokens are those of N = 0, the default; eager steps, no decode graphs)")
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


def _tiny_model_dir(cache_dir: Path) -> Path:
    """The tiny model, written once (exactly what `make-tiny --seed 0` writes) and reused."""
    path = cache_dir / "tiny-model"
    if (path / "config.json").exists() and not (path / "tokenizer.json").exists():  # cached by an older version
        from model.tiny import tiny_config
        from model.tokenizer_tiny import write_tiny_tokenizer

        write_tiny_tokenizer(path, tiny_config().vocab_size)
    if not (path / "config.json").exists():
        tmp = cache_dir / f"tiny-model.tmp{os.getpid()}"
        cmd_make_tiny(argparse.Namespace(out=tmp, seed=0, format="official"), quiet=True)
        tmp.rename(path)
    return path


def _model_dir(args: argparse.Namespace, env) -> Path:
    from cluster.startup import check_model

    model_dir = _tiny_model_dir(env.cache_dir) if args.model == "tiny" else Path(args.model)
    if not (model_dir / "config.json").exists():
        raise CliError(f"--model {model_dir}: no config.json there")
    check_model(model_dir)  # a bad config.json fails here, not in every worker after Ray started
    return model_dir


def _check_ports(args: argparse.Namespace) -> None:
    from cluster.startup import check_ports

    check_ports(args.host, {"--http-port": args.http_port, "--grpc-port": args.grpc_port})


def _router_config(args: argparse.Namespace, model_dir: Path):
    from router.config import PlacementConfig, RouterConfig
    from router.generation_defaults import GenerationDefaults
    from router.served_model import served_names, tokenizer_dir

    if (args.tls_cert is None) != (args.tls_key is None):
        raise CliError("--tls-cert and --tls-key must be given together")
    keys = list(args.api_key)
    if args.api_key_file is not None:
        try:
            keys += [k.strip() for k in args.api_key_file.read_text().splitlines() if k.strip()]
        except OSError as e:
            raise CliError(f"--api-key-file: {e}") from None
    names = served_names(model_dir, args.served_model_name)
    return RouterConfig(host=args.host, http_port=args.http_port, grpc_port=args.grpc_port, api_keys=tuple(keys),
                        model_name=names[0], model_aliases=names[1:],
                        tokenizer_dir=str(tokenizer_dir(model_dir, args.tokenizer)),
                        generation_defaults=GenerationDefaults.from_model_dir(model_dir),
                        tls_cert=str(args.tls_cert) if args.tls_cert else None,
                        tls_key=str(args.tls_key) if args.tls_key else None, access_log=args.access_log,
                        placement=PlacementConfig(remote_prefill_threshold=args.remote_prefill_threshold))


DEFAULT_DECODE_GRAPHS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _device_options(args: argparse.Namespace) -> dict:
    """WorkerOptions' device, kernels and decode_graphs from `up`'s flags and their defaults."""
    kernels = args.kernels or ("triton" if args.device == "cuda" else "torch")
    graphs = args.decode_graphs
    if graphs is None:
        capturable = args.device == "cuda" and kernels == "triton" and not args.speculative_tokens
        graphs = tuple(b for b in DEFAULT_DECODE_GRAPHS if b <= args.max_seqs) if capturable else ()
    if args.device == "cuda" and args.gpus_per_worker <= 0:
        raise CliError("--device cuda needs --gpus-per-worker > 0 (the GPU Ray gives each worker)")
    if args.device == "cpu" and kernels == "triton":
        raise CliError("--kernels triton needs --device cuda")
    if graphs and (args.device != "cuda" or kernels != "triton"):
        raise CliError("--decode-graphs needs --device cuda with the triton kernels")
    return {"device": args.device, "kernels": kernels, "decode_graphs": graphs, "load_format": args.load_format}


def cmd_up(args: argparse.Namespace) -> None:
    from cluster.settings import from_env

    _check_ports(args)  # first: before the imports of the whole serving stack
    env = from_env()
    model_dir = _model_dir(args, env)
    from cluster import up
    from cluster.launcher import ClusterOptions
    from worker_runtime.engine_metrics import MetricsOptions
    from worker_runtime.options import ExpertParallelOptions, WorkerOptions

    router = _router_config(args, model_dir)
    autoscale_config = None
    if args.autoscale == "policy":  # the defaults when no --autoscale-config is given
        from cluster.autoscaler import AutoscalerConfig

        try:
            raw = json.loads(args.autoscale_config.read_text()) if args.autoscale_config else {}
            autoscale_config = AutoscalerConfig.from_dict(raw)
        except (OSError, ValueError, TypeError) as e:
            raise CliError(f"--autoscale-config: {e}") from None
    worker = WorkerOptions(str(model_dir), "", cluster=args.cluster, kv_dtype=args.kv_dtype,
                           max_tokens=args.max_model_len, max_seqs=args.max_seqs,
                           prefill_token_budget=args.prefill_token_budget,
                           prefill_ep=ExpertParallelOptions(args.prefill_ep, args.prefill_ep_fp8_dispatch,
                                                            args.prefill_ep_timeout),
                           decode_ep=ExpertParallelOptions(args.decode_ep, timeout_s=args.decode_ep_timeout),
                           speculative_tokens=args.speculative_tokens,
                           logs=LogOptions(args.log_level, args.log_format, args.stats_interval),
                           metrics=MetricsOptions(args.worker_metrics_port, model_name=router.model_name or "v4serve",
                                                  stall_s=float(args.engine_stall_timeout)),
                           **_device_options(args))
    options = up.UpOptions(
        ClusterOptions(worker, prefill=args.prefill, decode=args.decode, gpus_per_worker=args.gpus_per_worker,
                       slots=None if autoscale_config is None else (
                           max(args.prefill, autoscale_config.prefill.max_replicas),
                           max(args.decode, autoscale_config.decode.max_replicas)),
                       prefill_resources=args.prefill_resources, decode_resources=args.decode_resources),
        router, autoscale=args.autoscale, autoscale_config=autoscale_config,
        start_timeout_s=float(args.start_timeout))
    asyncio.run(up.run(options, env, ready_line=lambda line: print(line, flush=True)))


def cmd_router(args: argparse.Namespace) -> None:
    _check_ports(args)
    from cluster import up
    from cluster.settings import from_env

    env = from_env()
    model_dir = _model_dir(args, env)
    options = up.RouterOptions(str(model_dir), _router_config(args, model_dir), cluster=args.cluster,
                               max_tokens=args.max_model_len)
    asyncio.run(up.run_router(options, env, ready_line=lambda line: print(line, flush=True)))


def cmd_drain(args: argparse.Namespace) -> int:
    import ray

    from cluster.settings import from_env

    address = args.address or from_env().ray_address or "auto"
    try:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError) as e:
        raise CliError(f"cannot reach a Ray cluster at {address}: {e}") from None
    try:
        found = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == args.worker
                 and args.namespace in (None, a["namespace"])]
        if len(found) != 1:
            spaces = sorted(a["namespace"] for a in found)
            raise CliError(f"no worker {args.worker!r} in the Ray cluster at {address}" if not found else
                           f"{args.worker!r} exists in namespaces {spaces}: pick one with --namespace")
        worker = ray.get_actor(args.worker, namespace=found[0]["namespace"])
        options = {"settle_s": args.settle, "timeout_s": args.timeout}
        if args.worker.startswith("decode-"):  # workers are named <role>-<n>
            options["migrate"] = not args.no_migrate
        result = ray.get(worker.drain.remote(**options))
    finally:
        ray.shutdown()
    print(json.dumps(result))
    return 0 if result["idle"] else 1


def cmd_make_tiny(args: argparse.Namespace, quiet: bool = False) -> None:
    import torch

    from model.checkpoint import write_checkpoint
    from model.tiny import random_weights, tiny_config
    from model.tokenizer_tiny import write_tiny_tokenizer
    from model.transformer import Transformer

    cfg = tiny_config()
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(cfg, with_mtp=args.format == "official").state_dict().items()}
    write_checkpoint(args.out, cfg, random_weights(shapes, cfg, args.seed), args.format)
    write_tiny_tokenizer(args.out, cfg.vocab_size)  # so Hugging Face clients can load it from the directory
    if not quiet:
        print(json.dumps({"model": str(args.out), "format": args.format, "seed": args.seed}))


def cmd_generate(args: argparse.Namespace) -> None:
    from model.checkpoint import load_checkpoint
    from model.generate import generate
    from model.kv_pool import KVPools
    from model.sampling import SamplingParams
    from model.tokenizer import load_tokenizer

    from router.generation_defaults import GenerationDefaults

    d = GenerationDefaults.from_model_dir(args.model) if (args.model / "config.json").exists() else GenerationDefaults()
    try:  # unset fields: the checkpoint's generation_config.json, as the server applies them
        params = SamplingParams(temperature=d.temperature if args.temperature is None else args.temperature,
                                top_p=d.top_p if args.top_p is None else args.top_p,
                                top_k=d.top_k if args.top_k is None else args.top_k, seed=args.seed)
    except ValueError as e:
        raise CliError(str(e)) from None
    spec = args.speculative_tokens
    cfg, model = load_checkpoint(args.model, with_mtp=spec > 0)
    tokenizer = load_tokenizer(args.model, cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    prompt = args.prompt_ids if args.prompt_ids is not None else tokenizer.encode(args.prompt)
    if not prompt:
        raise CliError("prompt is empty")
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if bad:
        raise CliError(f"prompt token ids out of range [0, {cfg.vocab_size}): {bad[:5]}")
    total = len(prompt) + args.max_new_tokens
    if total > cfg.max_position_embeddings:
        raise CliError(f"prompt ({len(prompt)} tokens) + max new tokens ({args.max_new_tokens}) exceeds the "
                       f"model's max_position_embeddings ({cfg.max_position_embeddings})")
    pools = KVPools(cfg, args.kv_dtype, max_tokens=total, max_seqs=1, with_mtp=spec > 0)
    stop = frozenset({cfg.eos_token_id} if cfg.eos_token_id is not None else ())
    out = generate(model, pools, prompt, args.max_new_tokens, params, chunk_size=args.chunk_size,
                   stop_ids=stop, keep_logits=args.logits_out is not None, speculative_tokens=spec)
    if args.logits_out is not None:
        np.save(args.logits_out, out.logits.numpy().astype(np.float32))
    line = {"token_ids": out.token_ids, "text": tokenizer.decode(out.token_ids), "finish_reason": out.finish_reason}
    if spec:
        line["spec"] = {"proposed": out.proposed, "accepted": out.accepted}
    print(json.dumps(line))


def cmd_make_config(args: argparse.Namespace) -> None:
    from model.checkpoint import write_config
    from model.tiny import flash_config

    presets = {"v4-flash": (flash_config, 43)}  # --preset → (config builder, its layers)
    build, total = presets[args.preset]
    layers = args.layers or total
    if layers > total:
        raise CliError(f"--layers {layers}: {args.preset} has {total} layers")
    print(write_config(args.out, build(layers)))


COMMANDS = {"make-tiny": cmd_make_tiny, "make-config": cmd_make_config, "generate": cmd_generate, "up": cmd_up,
            "router": cmd_router, "drain": cmd_drain}


def main(argv: list[str] | None = None) -> int:
    from cluster.startup import StartupError

    args = build_parser().parse_args(argv)
    logs = LogOptions(args.log_level, args.log_format, getattr(args, "stats_interval", 0.0))
    configure(logs)
    from cluster.settings import ray_log_defaults

    ray_log_defaults()  # before anything imports Ray
    try:
        status = COMMANDS[args.command](args)
    except (CliError, ValueError, FileNotFoundError, OSError) as e:  # config / checkpoint errors name the problem
        _report(e, logs)
        return 2
    except StartupError as e:
        _report(e, logs)
        return 1
    return status or 0


def _report(error: BaseException, logs: LogOptions) -> None:
    """One line `error: ...`; with --log-level debug, the traceback first."""
    if logs.debug:
        import traceback

        traceback.print_exception(error, file=sys.stderr)
    print(f"error: {error}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
