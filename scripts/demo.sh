#!/usr/bin/env bash
# One command: set up and run the embedded default (CPU, offline, a few minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec kvdistill demo "$@"
