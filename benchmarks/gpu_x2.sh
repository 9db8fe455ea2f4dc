#!/bin/bash
# On a 2-GPU host (nvidia-h200-x2): kvtransfer GPU tests and the V4-Flash hand-off benchmark
# (CUDA IPC copy kernel vs UCX), expert parallelism over 2 GPUs (NCCL), and the 2-GPU P/D slice
# (prefill GPU0, decode GPU1). Logs and JSON under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
quiet() { grep -v "NIXL INFO\|^I[0-9]* .*nixl"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nvidia-smi topo -m 2>&1 | head -3
echo "=== kvtransfer GPU tests"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kvtransfer_cuda.py tests/kvtransfer/test_kvt_paths.py \
    2>&1 | quiet | tee $OUT/kvt_tests.log | tail -4
echo "=== hand-off benchmark"
UCX_MAX_RNDV_RAILS=1 timeout 110 python3 benchmarks/kv_transfer_bench.py --repeats 10 --warmup 3 --path both \
    --out $OUT/kv_transfer.json 2>&1 | quiet | tee $OUT/kv_bench.log | tail -16
echo "=== EP over 2 GPUs"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_ep.py 2>&1 | tee $OUT/ep.log | tail -4
echo "=== P/D slice smoke"
timeout 60 python3 benchmarks/pd_gpu_slice.py --layers 3 --requests 1 --steps 6 --concurrency 1 16 \
    --out $OUT/slice_smoke.json 2>&1 | quiet | tail -6
echo "=== P/D slice"
timeout 200 python3 benchmarks/pd_gpu_slice.py --out $OUT/pd_slice.json 2>&1 | quiet | tee $OUT/pd_slice.log | tail -40
