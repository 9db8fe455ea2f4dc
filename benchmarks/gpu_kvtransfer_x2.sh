#!/bin/bash
# On a 2-GPU host: kvtransfer GPU tests, then the V4-Flash hand-off benchmark, whole pages (CUDA IPC
# vs UCX) and the streaming shapes (CUDA IPC: one send() per layer and pool, one per layer, one
# send_many() of every layer; many small spans through the copy kernel). JSON and logs under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
quiet() { grep -v "NIXL INFO\|^I[0-9]* .*nixl\|CudaIPCTypes"; }
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kvtransfer_cuda.py tests/kvtransfer/test_kvt_paths.py \
    tests/kvtransfer/test_send_batch.py \
    2>&1 | quiet | tail -3
UCX_MAX_RNDV_RAILS=1 timeout 120 python3 benchmarks/kv_transfer_bench.py --repeats 10 --warmup 3 --path both \
    --out $OUT/kv_transfer.json 2>&1 | quiet | tee $OUT/kv_bench.log | tail -16
timeout 120 python3 benchmarks/kv_transfer_bench.py --repeats 5 --warmup 2 --path ipc --per-layer --tokens 8192,32768 \
    --out $OUT/kv_transfer_per_layer.json 2>&1 | quiet | tee $OUT/kv_bench_per_layer.log | tail -20
