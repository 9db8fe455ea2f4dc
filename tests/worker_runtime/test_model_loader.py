"""A worker's replica from its options: device, kernels and decode graphs are validated up front
with errors naming the field, and the CPU replica is the reference model the oracle tests use."""

from __future__ import annotations

import io
import logging

import pytest
import torch
from safetensors.torch import load_file

from decode_worker.engine import DecodeEngine
from model.checkpoint import load_checkpoint, write_checkpoint, write_config
from model.kv_pool import KVPools
from model.load_progress import DUMMY, LoadProgress
from model.tokenizer import ByteTokenizer
from worker_runtime.logging_setup import LogOptions, load_progress
from worker_runtime.model_loader import load_replica
from worker_runtime.options import WorkerOptions
from worker_runtime.wire import GenerateRequest


@pytest.mark.parametrize("fields, message", [
    ({"device": "tpu"}, "device must be one of"),
    ({"kernels": "cutlass"}, "kernels must be one of"),
    ({"decode_graphs": (1, 8)}, "decode_graphs needs device 'cuda'"),
    ({"device": "cuda", "kernels": "torch", "decode_graphs": (8,)}, "kernels 'triton'"),
    ({"device": "cuda", "kernels": "triton", "decode_graphs": (8, 1)}, "increasing positive"),
    ({"device": "cuda", "kernels": "triton", "decode_graphs": (0, 4)}, "increasing positive"),
])
def test_bad_device_options_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        WorkerOptions("m", "", **fields)


def test_cpu_replica_is_the_reference_model(tiny_official_ckpt):
    options = WorkerOptions(str(tiny_official_ckpt), "", kv_dtype="fp32", max_tokens=512, max_seqs=3)
    cfg, model, pools = load_replica(options)
    _, ref = load_checkpoint(tiny_official_ckpt)
    assert pools.device == "cpu" and pools.format == "fp32"
    state, ref_state = model.state_dict(), ref.state_dict()
    assert state.keys() == ref_state.keys()
    assert all(torch.equal(state[k], ref_state[k]) for k in state)
    sized = KVPools(cfg, "fp32", page_size=options.page_size, max_tokens=512, max_seqs=3)
    assert pools.idle_free() == sized.idle_free()  # no spare request without decode graphs


def test_triton_kernels_on_cpu_refused(tiny_official_ckpt):
    with pytest.raises(ValueError, match="need device 'cuda'"):
        load_replica(WorkerOptions(str(tiny_official_ckpt), "", kernels="triton"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_without_a_gpu_names_the_fix(tiny_official_ckpt):
    with pytest.raises(RuntimeError, match="--gpus-per-worker"):
        load_replica(WorkerOptions(str(tiny_official_ckpt), "", device="cuda", kernels="triton"))


def test_engine_without_graphs_counts_every_page_idle(tiny_official_ckpt):
    cfg, model, pools = load_replica(WorkerOptions(str(tiny_official_ckpt), "", max_tokens=256, max_seqs=2))
    engine = DecodeEngine(model, pools, ByteTokenizer(cfg.vocab_size), "d")
    engine.submit(GenerateRequest("r", tuple(range(3, 40)), max_tokens=3))
    while engine.has_work():
        engine.step()
    assert pools.num_free() == engine.idle_free() == pools.idle_free()


def _progress(caplog) -> list[LoadProgress]:
    return [r.load_progress for r in caplog.records if r.name == "model.load_progress"]


def test_replica_loading_logs_its_progress(tmp_path, caplog, tiny_ckpt_cfg, tiny_ckpt_weights):
    """A worker's stderr is no terminal: its loading shows as log lines, the first (nothing done)
    and the last (every shard, every byte); dummy weights count layers (and the embedding, head)."""
    ckpt = write_checkpoint(tmp_path / "sharded", tiny_ckpt_cfg, tiny_ckpt_weights, "official", shard_bytes=300_000)
    shards = len(list(ckpt.glob("model-*.safetensors")))
    with caplog.at_level(logging.INFO, logger="model.load_progress"):
        load_replica(WorkerOptions(str(ckpt), "", max_tokens=256, max_seqs=2))
    first, *_, last = _progress(caplog)
    assert (first.done, first.bytes_done, first.total) == (0, 0, shards) and shards > 1
    assert last.finished and last.bytes_done == last.bytes_total == sum(
        t.numel() * t.element_size() for f in ckpt.glob("model-*.safetensors") for t in load_file(f).values()
    ) - _mtp_bytes(ckpt)

    caplog.clear()
    write_config(tmp_path / "dummy", tiny_ckpt_cfg)
    with caplog.at_level(logging.INFO, logger="model.load_progress"):
        _, model, _ = load_replica(WorkerOptions(str(tmp_path / "dummy"), "", load_format="dummy", max_tokens=256,
                                                 max_seqs=2))
    first, *_, last = _progress(caplog)
    layers = tiny_ckpt_cfg.num_hidden_layers + 1
    assert (first.what, first.unit, first.done, first.total) == (DUMMY, "layers", 0, layers)
    assert last.finished and last.done == layers and last.bytes_total == 0
    assert last.bytes_done == sum(t.nbytes for t in [*model.parameters(), *model.buffers()])


def _mtp_bytes(ckpt) -> int:
    """Bytes of the MTP block, which a worker without speculation does not read."""
    return sum(t.numel() * t.element_size() for f in ckpt.glob("model-*.safetensors")
               for k, t in load_file(f).items() if k.startswith("mtp."))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("logs, bar", [(LogOptions(), True), (LogOptions(format="json"), False),
                                       (LogOptions(level="warning"), False)])
def test_bar_only_on_a_terminal_with_text_logs(logs, bar):
    assert load_progress(logs, _Terminal()).bar is bar
    assert load_progress(logs, io.StringIO()).bar is False
