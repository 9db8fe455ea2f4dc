"""A worker checks at start that its largest step fits in GPU memory beside the weights and the
pools: with too little left it refuses to start, naming the flags; with enough, the step's
activations stay cached and the scratch request's pages go back to the pools."""

import pytest
import torch

from model.checkpoint import write_config
from model.tiny import flash_config
from worker_runtime.model_loader import check_step_fits, load_replica
from worker_runtime.options import WorkerOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_a_step_that_does_not_fit_refuses_the_start_and_one_that_fits_passes(tmp_path):
    write_config(tmp_path, flash_config(2))
    _, model, pools = load_replica(WorkerOptions(str(tmp_path), "", load_format="dummy", device="cuda",
                                                 kernels="triton", kv_dtype="fp8_pack", max_tokens=8448,
                                                 max_seqs=2))
    free_pages = {k: a.num_free() for k, a in pools.allocators.items()}
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    ballast = torch.empty(free - (256 << 20), dtype=torch.uint8, device="cuda")  # leave 256 MiB
    with pytest.raises(RuntimeError, match="--prefill-token-budget") as e:
        check_step_fits(model, pools, 8192, "--prefill-token-budget")
    assert "8192 tokens in one step does not fit" in str(e.value)
    assert {k: a.num_free() for k, a in pools.allocators.items()} == free_pages
    del ballast
    torch.cuda.empty_cache()
    check_step_fits(model, pools, 8192, "--prefill-token-budget")
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() > 256 << 20  # the step's cache stays
    assert {k: a.num_free() for k, a in pools.allocators.items()} == free_pages
