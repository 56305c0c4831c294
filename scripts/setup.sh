#!/usr/bin/env bash
# Create .venv (once) and install kvdistill into it. Idempotent: a second call is fast.
# KVDISTILL_EXTRAS picks the pyproject extras (default "dev"; scripts/test.sh adds eval, tensorboard, wandb, peer, gguf, peft).
# GPU users: set KVDISTILL_TORCH to the torch spec you want (e.g. "torch" for the CUDA build);
# the default pins the CPU build that these machines serve.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  pip install -q "${KVDISTILL_TORCH:-torch==2.13.0}"
fi
pip install -q -c scripts/constraints.txt -e ".[${KVDISTILL_EXTRAS:-dev}]"
