#!/bin/bash
# One-GPU final run: every GPU-side test (kernels, model, MoE, kvtransfer on one GPU), then the
# kernel and decode-step benchmarks. Logs and JSON under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
quiet() { grep -v "NIXL INFO\|^I[0-9]* .*nixl\|CudaIPCTypes"; }
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/model/test_kernels_*.py tests/model/test_moe*.py \
    tests/model/test_model_kernels.py tests/kvtransfer/test_kvt_paths.py 2>&1 | quiet | tee $OUT/tests.log | tail -8
timeout 120 python3 benchmarks/kernel_bench.py --out $OUT/kernels.json 2>&1 | tee $OUT/kernels.log | tail -3
timeout 200 python3 benchmarks/decode_step_bench.py --out $OUT/decode_step.json 2>&1 \
    | grep -v "^ \|^---\|^Self\|^void\|^std\|^nvjet\|^sm80\|Name\|UserWarn" | tee $OUT/decode_step.log
