#!/usr/bin/env bash
# One command: set up and run the embedded default, the binding regime (CPU, offline; about 9 min on 2 cores
# after setup; `--task arithmetic` for the first demo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec kvdistill demo "$@"
