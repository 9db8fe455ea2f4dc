"""The sender's per-layer checksum terms computed on the GPU (torch ops on the pages' device, no
host copy) equal the CPU's, and summed over the layers equal page_checksum of whole pages on
either device: a prefill worker that checksums layer by layer while the model runs sends the
TransferDone checksums a receiver verifies as ever."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.checksum import page_checksum, pool_checksums, range_checksum_tensor
from kvtransfer.regions import layer_byte_range

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("page_bytes,layers", [(43 * 584 * 4, 43), (41 * 1024, 41), (2 * 37, 2)])
def test_gpu_layer_terms_equal_the_cpus_and_sum_to_the_whole_page_checksum(page_bytes, layers):
    gen = torch.Generator().manual_seed(5)
    cpu = torch.randint(0, 256, (64, page_bytes), dtype=torch.uint8, generator=gen)
    gpu = cpu.cuda()
    ids = [int(i) for i in torch.randperm(64, generator=gen)[:24]]
    lead, rest = ids[:5], ids[5:]
    total = range_checksum_tensor(gpu, lead)
    for layer in range(layers):
        r = layer_byte_range(page_bytes, layers, layer)
        on_gpu = range_checksum_tensor(gpu, rest, len(lead), r)
        assert on_gpu.device.type == "cuda"
        assert int(on_gpu) == int(range_checksum_tensor(cpu, rest, len(lead), r))
        total = total + on_gpu
    assert int(total) == page_checksum(cpu, ids) == page_checksum(gpu, ids)
    assert pool_checksums({"k": gpu}, {"k": ids}, {"k": total}) == {"k": page_checksum(cpu, ids)}
