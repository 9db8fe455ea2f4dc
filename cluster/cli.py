"""`v4serve` command line: make-tiny, make-config, generate, up (own the pools and serve them),
router (serve pools owned elsewhere), drain (empty a worker of a running cluster).

Arguments are parsed (cluster/cli_parser.py) and validated here, turned into frozen option objects
once, and passed explicitly; bad input prints one line `error: ...` on stderr and exits with status 2. A start-up
that fails (a port in use, a worker that cannot be placed or whose checkpoint is bad) prints one
line `error: ...` and exits with status 1; `--log-level debug` adds the traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

import numpy as np

from cluster.cli_parser import build_parser
from worker_runtime.logging_setup import LogOptions, configure, load_progress


class CliError(Exception):
    """A user error: reported as one line, exit status 2."""


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
        capturable = args.device == "cuda" and kernels == "triton"
        graphs = tuple(b for b in DEFAULT_DECODE_GRAPHS if b <= args.max_seqs) if capturable else ()
    if args.device == "cuda" and args.gpus_per_worker <= 0:
        raise CliError("--device cuda needs --gpus-per-worker > 0 (the GPU Ray gives each worker)")
    if args.device == "cpu" and kernels == "triton":
        raise CliError("--kernels triton needs --device cuda")
    if graphs and (args.device != "cuda" or kernels != "triton"):
        raise CliError("--decode-graphs needs --device cuda with the triton kernels")
    return {"device": args.device, "kernels": kernels, "decode_graphs": graphs, "load_format": args.load_format}


def _worker_options(args: argparse.Namespace, model_dir: Path, router):
    """Every worker's WorkerOptions from `up`'s flags; the tokenizer is the router's (`--tokenizer`)."""
    from worker_runtime.engine_metrics import MetricsOptions
    from worker_runtime.options import ExpertParallelOptions, WorkerOptions

    return WorkerOptions(str(model_dir), "", tokenizer_dir=router.tokenizer_dir, cluster=args.cluster,
                         kv_dtype=args.kv_dtype, max_tokens=args.max_model_len, max_seqs=args.max_seqs,
                         prefill_token_budget=args.prefill_token_budget,
                         prefill_ep=ExpertParallelOptions(args.prefill_ep, args.prefill_ep_fp8_dispatch,
                                                          args.prefill_ep_timeout),
                         decode_ep=ExpertParallelOptions(args.decode_ep, timeout_s=args.decode_ep_timeout),
                         speculative_tokens=args.speculative_tokens, deterministic=args.deterministic,
                         speculative_max_batch=args.speculative_max_batch,
                         overlap=not args.no_overlap,
                         logs=LogOptions(args.log_level, args.log_format, args.stats_interval),
                         metrics=MetricsOptions(args.worker_metrics_port, model_name=router.model_name or "v4serve",
                                                stall_s=float(args.engine_stall_timeout)),
                         **_device_options(args))


def cmd_up(args: argparse.Namespace) -> None:
    from cluster.settings import from_env

    _check_ports(args)  # first: before the imports of the whole serving stack
    env = from_env()
    model_dir = _model_dir(args, env)
    from cluster import up
    from cluster.launcher import ClusterOptions

    router = _router_config(args, model_dir)
    autoscale_config = None
    if args.autoscale == "policy":  # the defaults when no --autoscale-config is given
        from cluster.autoscaler import AutoscalerConfig

        try:
            raw = json.loads(args.autoscale_config.read_text()) if args.autoscale_config else {}
            autoscale_config = AutoscalerConfig.from_dict(raw)
        except (OSError, ValueError, TypeError) as e:
            raise CliError(f"--autoscale-config: {e}") from None
    worker = _worker_options(args, model_dir, router)
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
    from model.kernels import set_deterministic
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
    cfg, model = load_checkpoint(args.model, with_mtp=spec > 0,
                                 progress=load_progress(LogOptions(args.log_level, args.log_format)))
    set_deterministic(model, args.deterministic)  # the CPU's reference ops: batch-invariant either way
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
