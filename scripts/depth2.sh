#!/usr/bin/env bash
# The two-hop binding assets of configs/demo/evidence_binding_depth2.yaml (issue 51): its depth-2 data (~1 min) and
# its teacher, teacher_llama_d2, copied from assets/binding/depth2/ after checking its hashes.
#   bash scripts/depth2.sh            data + the shipped teacher
#   bash scripts/depth2.sh --retrain  data + the teacher trained again (35 min on 2 busy cores), gated at 0.98 on dev
#   bash scripts/depth2.sh --ship     --retrain, then written to assets/binding/depth2/ with its manifest (maintainers)
# Needs the one-hop demo's outputs (kvdistill demo --task binding): its inits and tokenizer, and teacher_llama, which
# the two-hop teacher is fine-tuned from.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-install}"
case "$mode" in install|--retrain|--ship) ;; *) echo "usage: bash scripts/depth2.sh [--retrain | --ship]" >&2; exit 2;; esac
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
demo=outputs/demo_binding out=outputs/demo_binding/depth2
if [ ! -f "$demo/teachers/teacher_llama/model.safetensors" ]; then
  echo "depth2.sh: $demo has no teacher_llama; run \`kvdistill demo --task binding\` first (~9 min)" >&2; exit 1
fi
[ -f "$out/data/test.jsonl" ] || kvdistill gen-data --task binding --depth 2 --seed 0 --n_pool 100000 --n_train 1000 \
  --n_dev 300 --n_teacher_dev 300 --n_test 500 --output_dir "$out/data"
teacher="$out/teachers/teacher_llama_d2"
if [ "$mode" = install ]; then
  exec python - "$demo/init" "$teacher" <<'EOF'
import sys
from pathlib import Path
from kvdistill.config import ConfigError
from kvdistill.lab.regimes import install_teacher
try:
    install_teacher("binding/depth2", "teacher_llama_d2", Path(sys.argv[1]), Path(sys.argv[2]))
except ConfigError as err:
    sys.exit(f"depth2.sh: {err}")
print(f"teacher_llama_d2 -> {sys.argv[2]}")
EOF
fi
# the teacher as shipped: teacher_llama fine-tuned on the depth-2 teacher pool, stopped at 0.98 on teacher_dev
train=(train --config configs/demo/binding/teacher.yaml --student "$demo/teachers/teacher_llama" --data "$out/data"
       --data_split teacher_pool --max_steps 6000 --seed 0 --accuracy_eval_steps 500 --accuracy_eval_split teacher_dev
       --accuracy_eval_limit 300 --accuracy_eval_max_new_tokens 4 --accuracy_stop 0.98 --output_dir "$teacher")
[ -f "$teacher/train_summary.json" ] || kvdistill "${train[@]}"  # torch's default threads, as shipped
# its gate: the 300 dev programs, which chose nothing (the demo's gate reads each teacher's held-out split the same way)
evaluate=(eval --model "$teacher" --data "$out/data" --split dev --limit 300 --batch_size 100 --max_new_tokens 48
          --max_length 256 --output_dir "$out/eval_dev/teacher_llama_d2" --no_progress)
[ -f "$out/eval_dev/teacher_llama_d2/summary.json" ] || kvdistill "${evaluate[@]}"
[ "$mode" = --ship ] || exit 0
python - "$demo/init" "$teacher" "$out/eval_dev/teacher_llama_d2" "${train[*]}" <<'EOF'
import sys
from pathlib import Path
import torch
from kvdistill.io import read_json
from kvdistill.lab.regimes import ASSETS, ship_run, write_manifest
from kvdistill.report import environment
init, teacher, gate, command = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4].split()
acc = read_json(gate / "summary.json")["accuracy"]
entry = ship_run(teacher, ASSETS / "binding/depth2/teacher_llama_d2", ("dev", acc), command)
# trained in this script's shell, with torch's default threads: the count this process gets
path = write_manifest(ASSETS / "binding/depth2", init, {"teacher_llama_d2": entry}, torch.get_num_threads(),
                      environment())
print(f"shipped teacher_llama_d2 (dev {acc:.3f}) -> {path.parent}")
EOF
