#!/bin/bash
# One-GPU final run in parts, each inside one 10-minute device call (the whole test list took
# ~13 minutes on an H200): `bash benchmarks/gpu_final.sh tests-a|tests-b|tests-c|bench`, or no
# argument for all four in turn. tests-a / tests-b: tests/gpu split by file name (a-l, m-z; the
# 2-GPU tests skip on one GPU: benchmarks/gpu_x2.sh), tests-b with the kernel parity tests of
# tests/model; tests-c: the MoE and whole-model kernel tests and kvtransfer on one GPU; bench:
# the kernel and decode-step benchmarks. Logs and JSON under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
quiet() { grep -v "NIXL INFO\|^I[0-9]* .*nixl\|CudaIPCTypes"; }
tests() {  # log name, then pytest arguments
    local log=$1; shift
    timeout 560 python3 -m pytest -q -p no:cacheprovider --durations=10 "$@" 2>&1 | quiet | tee "$OUT/$log.log" | tail -16
}
part=${1:-all}
case $part in
    tests-a|all) tests tests-a tests/gpu/test_[a-l]*.py ;;&
    tests-b|all) tests tests-b tests/gpu/test_[m-z]*.py tests/model/test_kernels_*.py ;;&
    tests-c|all) tests tests-c tests/model/test_moe*.py tests/model/test_model_kernels.py tests/kvtransfer/test_kvt_paths.py ;;&
    bench|all)
        timeout 120 python3 benchmarks/kernel_bench.py --out $OUT/kernels.json 2>&1 | tee $OUT/kernels.log | tail -3
        timeout 200 python3 benchmarks/decode_step_bench.py --out $OUT/decode_step.json 2>&1 \
            | grep -v "^ \|^---\|^Self\|^void\|^std\|^nvjet\|^sm80\|Name\|UserWarn" | tee $OUT/decode_step.log ;;
    tests-a|tests-b|tests-c) ;;
    *) echo "unknown part '$part': tests-a, tests-b, tests-c or bench" >&2; exit 2 ;;
esac
