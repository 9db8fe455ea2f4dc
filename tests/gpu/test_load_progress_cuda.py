"""Weight-loading progress of a CUDA worker's replica: dummy weights made on the GPU count every
layer and every byte the model holds there; a sharded checkpoint loaded onto the GPU counts every
shard and byte read."""

import logging

import pytest
import torch

from model.checkpoint import write_checkpoint, write_config
from model.load_progress import DUMMY
from worker_runtime.model_loader import load_replica
from worker_runtime.options import WorkerOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _progress(caplog):
    return [r.load_progress for r in caplog.records if r.name == "model.load_progress"]


def test_dummy_weights_on_the_gpu_report_every_layer(tmp_path, caplog, tiny_ckpt_cfg):
    write_config(tmp_path, tiny_ckpt_cfg)
    with caplog.at_level(logging.INFO, logger="model.load_progress"):
        _, model, _ = load_replica(WorkerOptions(str(tmp_path), "", load_format="dummy", device="cuda",
                                                 kernels="triton", kv_dtype="fp8_pack", max_tokens=256, max_seqs=2))
    first, *_, last = _progress(caplog)
    assert (first.what, first.done, first.total) == (DUMMY, 0, tiny_ckpt_cfg.num_hidden_layers + 1)
    held = [*model.parameters(), *model.buffers()]
    assert last.finished and last.bytes_done == sum(t.nbytes for t in held)


def test_sharded_checkpoint_onto_the_gpu(tmp_path, caplog, tiny_ckpt_cfg, tiny_ckpt_weights):
    ckpt = write_checkpoint(tmp_path, tiny_ckpt_cfg, tiny_ckpt_weights, "official", shard_bytes=300_000)
    with caplog.at_level(logging.INFO, logger="model.load_progress"):
        load_replica(WorkerOptions(str(ckpt), "", device="cuda", kernels="triton", kv_dtype="fp8_pack",
                                   max_tokens=256, max_seqs=2))
    first, *_, last = _progress(caplog)
    shards = len(list(ckpt.glob("model-*.safetensors")))
    assert first.total == shards > 1 and last.finished and last.bytes_done == last.bytes_total > 0
