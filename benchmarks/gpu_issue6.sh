#!/bin/bash
# On the GPU machine: the GPU path's parity tests, then (with "bench") the kernel, MoE and
# decode-step benchmarks. Results (logs, JSON) under $OUT.
#   bash benchmarks/gpu_issue6.sh tests | bench | all
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
what="${1:-all}"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "$what" = tests ] || [ "$what" = all ]; then
  files=$(ls tests/gpu/test_kernels_flash.py tests/gpu/test_model_gpu.py tests/gpu/test_moe*.py \
      tests/model/test_kernels_*.py tests/model/test_moe*.py tests/model/test_model_kernels.py 2>/dev/null)
  timeout 480 python3 -m pytest -q -p no:cacheprovider --durations=15 $files 2>&1 | tee $OUT/tests.log | tail -40
fi
if [ "$what" = moe ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_kernels_cuda.py tests/model/test_moe_kernels.py \
      2>&1 | tee $OUT/moe_tests.log | tail -15
  timeout 240 python3 -m benchmarks.moe_bench --quick --out $OUT/moe.json 2>&1 | tee $OUT/moe.log | tail -40
  timeout 400 python3 benchmarks/decode_step_bench.py --out $OUT/decode_step.json 2>&1 | tee $OUT/decode_step.log
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 200 python3 benchmarks/kernel_bench.py --out $OUT/kernels.json 2>&1 | tee $OUT/kernels.log
  [ -f benchmarks/moe_bench.py ] && timeout 200 python3 benchmarks/moe_bench.py --out $OUT/moe.json 2>&1 | tee $OUT/moe.log | tail -20
  timeout 400 python3 benchmarks/decode_step_bench.py --out $OUT/decode_step.json 2>&1 | tee $OUT/decode_step.log
fi
