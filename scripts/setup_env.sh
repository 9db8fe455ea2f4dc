#!/usr/bin/env bash
# Creates .venv with the CPU build of torch and v4serve installed (editable), plus the extras
# named in $1 (e.g. "test"). Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
