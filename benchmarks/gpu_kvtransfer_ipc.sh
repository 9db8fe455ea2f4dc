#!/bin/bash
# On a 2-GPU host: install the NIXL wheels carried in .whl/, run the V4-Flash hand-off benchmark
# with both data paths in one run (CUDA IPC, the default, and UCX forced; UCX_MAX_RNDV_RAILS=1),
# then the CUDA kvtransfer tests (CUDA IPC GPU0 -> GPU1 between two processes, peer restart,
# faults, UCX with IPC off), then the benchmark again without NIXL's progress thread (both sides
# poll in a loop, which UCX then needs). JSON and logs go under $OUT.
#     bash benchmarks/gpu_kvtransfer_ipc.sh        # from the repository root, OUT=<dir>
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 NCCL_NVLS_ENABLE=0 \
       TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/kvt_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
quiet() { grep -v "NIXL INFO\|^I[0-9]* .*nixl"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m 2>&1 | head -4
python3 - <<'EOF' 2>&1 | quiet
import torch, importlib.metadata as md
from kvtransfer.cuda_ipc import host_id
n = torch.cuda.device_count()
print("torch", torch.__version__, "gpus", n, "nixl", md.version("nixl"), "host", host_id())
if n >= 2:
    print("peer access 0->1:", torch.cuda.can_device_access_peer(0, 1))
EOF

echo "=== benchmark: both paths, UCX_MAX_RNDV_RAILS=1, NIXL progress thread on (default)"
UCX_MAX_RNDV_RAILS=1 timeout 100 python3 benchmarks/kv_transfer_bench.py --repeats 10 --warmup 3 \
    --path both --out "$OUT/kv_transfer_ipc_vs_ucx.json" 2>&1 | quiet \
    | tee "$OUT/bench.log" | tail -20

echo "=== GPU tests"
timeout 130 python3 -m pytest tests/gpu/test_kvtransfer_cuda.py -q -s -rfE --noconftest \
    -p no:cacheprovider 2>&1 | quiet | tee "$OUT/gpu_tests.log" \
    | grep -E "mapping:|passed|failed|error|Error|assert" | tail -40

echo "=== benchmark: both paths, UCX_MAX_RNDV_RAILS=1, NIXL progress thread off"
UCX_MAX_RNDV_RAILS=1 timeout 90 python3 benchmarks/kv_transfer_bench.py --repeats 10 --warmup 3 \
    --path both --progress-thread off --out "$OUT/kv_transfer_ipc_vs_ucx_noprog.json" 2>&1 \
    | quiet | tee "$OUT/bench_noprog.log" | tail -20
