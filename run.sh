#!/usr/bin/env bash
# The main job on a fresh machine: install, create the tiny model once, serve one request.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup_env.sh transfer
model=.cache/tiny-model
[ -f "$model/config.json" ] || .venv/bin/v4serve make-tiny --out "$model" --seed 0
.venv/bin/v4serve generate --model "$model" --prompt "DeepSeek-V4 says:" --max-new-tokens 24 "$@"
