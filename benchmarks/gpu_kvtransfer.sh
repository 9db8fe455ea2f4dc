#!/bin/bash
# On the GPU machine (2 GPUs): install the NIXL wheels carried in .whl/, run the CUDA transfer
# tests, sweep UCX settings for the V4-Flash hand-off at 32K/128K tokens, then the full benchmark
# (8K, 32K, 128K) with the best setting. Writes JSON results under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 200 python3 -m pytest tests/gpu/test_kvtransfer_cuda.py -q --noconftest -p no:cacheprovider 2>&1 | grep -v "NIXL INFO" | tail -3
best=""; best_bw=0
i=0
for variant in "" "UCX_MAX_RNDV_RAILS=1" "UCX_TLS=cuda_ipc,cuda_copy,tcp,self" "UCX_MAX_RNDV_RAILS=1 UCX_RNDV_SCHEME=put_zcopy"; do
  i=$((i+1))
  echo "=== sweep $i: ${variant:-default}"
  env $variant timeout 150 python3 benchmarks/kv_transfer_bench.py --tokens 32768,131072 --repeats 5 --warmup 2 \
      --out $OUT/sweep_$i.json 2>&1 | grep -v "NIXL INFO" | tail -6
  bw=$(python3 -c "import json,sys; r=json.load(open('$OUT/sweep_$i.json')); print(max(x['write_vs_copy'] for x in r['sizes']))" 2>/dev/null || echo 0)
  echo "ratio=$bw"
  if python3 -c "import sys; sys.exit(0 if float('$bw') > float('$best_bw') else 1)"; then best="$variant"; best_bw=$bw; fi
done
echo "=== full run with: ${best:-default}"
env $best timeout 240 python3 benchmarks/kv_transfer_bench.py --repeats 10 --warmup 3 --out $OUT/kv_transfer.json 2>&1 \
    | grep -v "NIXL INFO" | tail -12
echo "best=${best:-default}"
