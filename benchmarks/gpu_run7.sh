#!/bin/bash
# One-GPU check run: MoE and kvtransfer GPU tests, a 3-layer smoke of the P/D slice, the decode-step bench.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
quiet() { grep -v "NIXL INFO\|^I[0-9]* .*nixl"; }
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_kernels_cuda.py tests/model/test_moe_kernels.py \
    tests/gpu/test_kvtransfer_cuda.py tests/kvtransfer/test_kvt_paths.py 2>&1 | quiet | tee $OUT/tests.log | tail -12
timeout 150 python3 benchmarks/pd_gpu_slice.py --layers 3 --requests 1 --steps 6 --concurrency 1 16 \
    --out $OUT/slice_smoke.json 2>&1 | quiet | tail -25
timeout 240 python3 benchmarks/decode_step_bench.py --out $OUT/decode_step.json 2>&1 \
    | grep -v "^ \|^---\|^Self\|^void\|^std\|^nvjet\|^sm80\|Name\|UserWarn" | tee $OUT/decode_step.log
