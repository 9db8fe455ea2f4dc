"""An expert-parallel decode group on 2 GPUs (skipped with fewer), as two decode workers of
`v4serve up --device cuda --decode-ep 2` run it, minus Ray: each rank loads the replica, joins
the group (gloo agreement, NCCL exchanges), captures its decode graphs with its peer (each bucket
with that bucket's fixed exchange capacity), and steps its decode engine in lockstep.

Rank 0 serves three requests, rank 1 one short one, so most steps find rank 1 without a request:
it replays the agreed bucket's graph on padding rows. Checked: the steps after the prompts replay
graphs on both ranks; rank 1 joined steps idle; the tokens agree with the same requests on one
GPU without expert parallelism, eagerly (not bitwise: the experts' rows cross the wire in bf16 and
graphs pad rows, docs/gpu.md), teacher forced: after each prefix the group decoded, its token is
the reference's best, within a near-tie of it, or the reference's own pick when its MoE outputs
carry noise of the exchange's rounding, so one flip does not decide a whole sequence; and every
page comes back. On 2×H200 2 of 48 tokens were not the reference's best: one a near-tie, the
other (0.56 below, half the logits' spread) at one of the 6 positions where that noise moves the
reference's pick."""

from __future__ import annotations

import faulthandler
import json
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

MAX_TOKENS = 16
BUCKETS = (1, 2, 4)
NOISE, NOISE_SEEDS = 2.0 ** -8, 4  # twice bf16's unit rounding, on every MoE layer's output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _requests(rank: int):
    from worker_runtime.wire import GenerateRequest

    g = torch.Generator().manual_seed(rank)
    lengths, max_tokens = ((150, 37, 90), MAX_TOKENS) if rank == 0 else ((60,), 4)
    return [GenerateRequest(f"r{rank}-{i}", tuple(torch.randint(0, 256, (n,), generator=g).tolist()),
                            max_tokens=max_tokens, ignore_eos=True) for i, n in enumerate(lengths)]


def _rank_main(rank: int, ckpt: str, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from decode_worker.engine import DecodeConfig, DecodeEngine
    from model.tokenizer import ByteTokenizer
    from worker_runtime.ep_group import ExpertParallelGroup, Seat
    from worker_runtime.model_loader import DecodeGraphs, load_replica
    from worker_runtime.options import ExpertParallelOptions, WorkerOptions

    faulthandler.dump_traceback_later(300, exit=True)  # a rank out of lockstep hangs: end it, with its stack
    torch.cuda.set_device(rank)
    ep = ExpertParallelOptions(size=2, timeout_s=120.0)
    options = WorkerOptions(ckpt, "", kv_dtype="fp8_pack", max_tokens=512, max_seqs=4, device="cuda",
                            kernels="triton", decode_graphs=BUCKETS, decode_ep=ep)
    cfg, model, pools = load_replica(options)
    store = dist.TCPStore("127.0.0.1", port, None, is_master=True, timeout=timedelta(seconds=120),
                          wait_for_workers=False) if rank == 0 else None
    group = ExpertParallelGroup(Seat("127.0.0.1", port, rank, 2, ("d0", "d1")), "127.0.0.1", ep, "cuda", model,
                                [], store)
    graphs = DecodeGraphs(model, pools, BUCKETS, options.max_tokens, expert_parallel=True)
    tokenizer = ByteTokenizer(cfg.vocab_size)
    engine = DecodeEngine(model, pools, tokenizer, f"d{rank}", DecodeConfig(max_running=4), graphs)
    requests = _requests(rank)
    for r in requests:
        engine.submit(r)
    tokens = {r.request_id: [] for r in requests}
    while (out := group.step(engine)) is not None:  # None on every rank at once: no rank has work
        for chunk in out:
            assert chunk.error is None, chunk.error
            tokens[chunk.request_id] += chunk.token_ids
    result = {"tokens": tokens, "replays": graphs.replays, "status": group.status(),
              "idle": pools.num_free() == engine.idle_free()}

    # the same requests on this GPU without expert parallelism, eagerly (the reference)
    options1 = WorkerOptions(ckpt, "", kv_dtype="fp8_pack", max_tokens=512, max_seqs=4, device="cuda",
                             kernels="triton")
    _, model1, pools1 = load_replica(options1)
    engine1 = DecodeEngine(model1, pools1, tokenizer, "e", DecodeConfig(max_running=4))
    for r in requests:
        engine1.submit(r)
    result["eager"] = {r.request_id: [] for r in requests}
    while engine1.has_work():
        for chunk in engine1.step():
            result["eager"][chunk.request_id] += chunk.token_ids
    # teacher forced: the reference's logits after every prefix the group decoded, so that one
    # near-tie flipped by the exchange does not decide every later position of a sequence. Kept
    # per position: how far below the reference's best the group's token scored, the logits'
    # spread, and the tokens the reference picks when every MoE layer's output carries noise of
    # the exchange's size (relative NOISE, NOISE_SEEDS seeds): the group rounds each expert's rows
    # to bf16 before the combine where one GPU rounds their sum once, and where that much noise
    # moves the reference's choice (an expert's selection or two logits near a tie) either token is right
    from model.generate import generate
    from model.moe import MoE
    from model.sampling import SamplingParams

    noise = {}

    def perturb(module, args, out):
        if "gen" not in noise:
            return out
        rel = torch.randn(out.shape, generator=noise["gen"], device=out.device, dtype=torch.float32)
        return (out.float() * (1 + NOISE * rel)).to(out.dtype)

    for module in model1.modules():
        if isinstance(module, MoE):
            module.register_forward_hook(perturb)

    def logits_after(prefix: list[int], seed: int | None = None) -> torch.Tensor:
        if seed is not None:
            noise["gen"] = torch.Generator(device=options1.device).manual_seed(seed)
        try:
            return generate(model1, pools1, prefix, 1, SamplingParams(), keep_logits=True).logits[0]
        finally:
            noise.clear()

    result["forced"] = {}
    for r in requests:
        got = tokens[r.request_id]
        rows = []
        for j in range(1, len(got)):
            prefix = list(r.prompt_ids) + got[:j]
            logits = logits_after(prefix)
            # the picks with and without the noise (the best itself cannot excuse a token below it)
            noised = sorted({int(logits.argmax())} | {int(logits_after(prefix, seed).argmax())
                                                      for seed in range(NOISE_SEEDS)})
            rows.append([float(logits.max() - logits[got[j]]), float(logits.std()), noised])
        result["forced"][r.request_id] = rows
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # without tearing the NCCL group down: its abort can wait on a peer that already left


def test_expert_parallel_decode_group_replays_graphs_in_lockstep(tiny_official_ckpt, tmp_path):
    mp.spawn(_rank_main, args=(str(tiny_official_ckpt), _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1))
    s0, s1 = r0["status"], r1["status"]
    assert s0["meetings"] == s1["meetings"] and s0["state"] == s1["state"] == "active"
    assert s1["idle_steps"] >= MAX_TOKENS - 6  # rank 1's request ended after 4 tokens
    # every all-decode step replayed a graph: rank 0's busy ones, rank 1's idle ones too
    assert r0["replays"] >= MAX_TOKENS - 2 and r1["replays"] >= MAX_TOKENS - 4
    assert r0["idle"] and r1["idle"]
    got = {**r0["tokens"], **r1["tokens"]}
    eager = {**r0["eager"], **r1["eager"]}
    assert all(len(t) == (MAX_TOKENS if rid.startswith("r0") else 4) for rid, t in got.items())
    assert all(got[r][0] == eager[r][0] for r in got)  # first tokens: the prefill step
    # every later token is the reference's greedy choice after the same prefix, a near-tie of it
    # (within a tenth of the logits' spread; a wrong exchange or expert slice scores most tokens
    # about a spread below the best), or what the reference picks under the exchange's noise; and
    # both are a minority, so neither excuse covers a broken group. Free-running, one flip changes
    # the rest of a sequence: 2 of the 4 matched whole on 2×H200
    forced = {**r0["forced"], **r1["forced"]}
    assert sorted(len(rows) for rows in forced.values()) == [3] + [MAX_TOKENS - 1] * 3
    below = [(r, j, gap, spread, noised) for r, rows in forced.items() for j, (gap, spread, noised) in enumerate(rows, 1)
             if gap > 0]
    moved = [(r, j, noised) for r, rows in forced.items() for j, (*_, noised) in enumerate(rows, 1) if len(noised) > 1]
    print("below the reference's best (request, position, gap, spread, noised reference's picks):", below)
    print("positions where the exchange's noise moves the reference's pick:", moved)
    assert all(gap <= 0.1 * spread or got[r][j] in noised for r, j, gap, spread, noised in below), below
    assert len(below) <= 3 * MAX_TOKENS // 5, below
    assert len(moved) <= sum(len(rows) for rows in forced.values()) // 4, moved
