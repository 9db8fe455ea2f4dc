#!/usr/bin/env bash
# The main job on a fresh machine: install, then serve the tiny model (created once, cached) on a
# local 1-prefill / 1-decode cluster until Ctrl-C. Extra arguments go to `v4serve up`.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup_env.sh
exec .venv/bin/v4serve up "$@"
