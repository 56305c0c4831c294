#!/usr/bin/env bash
# An ablation's records without its weights, kept where git keeps them: a sweep longer than one session on a
# machine whose outputs/ do not survive it resumes on the next one from these.
#   bash scripts/keep_runs.sh OUTPUT_DIR RECORD_DIR            copy each evaluated run's records into RECORD_DIR
#   bash scripts/keep_runs.sh --restore OUTPUT_DIR RECORD_DIR  copy them back; the same `kvdistill ablate` then
#                                                              skips those runs (finished) and runs the rest
# Records: the preregistration, and per run its asked config, train summary, per-step metrics and evaluation:
# what the report reads (kvdistill.runs.read_run) and what the ablation checks before it reuses a run dir.
set -euo pipefail
restore=0
if [ "${1:-}" = "--restore" ]; then restore=1; shift; fi
if [ $# -ne 2 ]; then echo "usage: bash scripts/keep_runs.sh [--restore] OUTPUT_DIR RECORD_DIR" >&2; exit 2; fi
out=$1 record=$2
if [ "$restore" = 1 ]; then
  [ -f "$record/preregistration.json" ] || { echo "keep_runs.sh: $record holds no preregistration.json" >&2; exit 1; }
  mkdir -p "$out" && cp -r "$record/." "$out/"
  echo "restored $(find "$record/runs" -name summary.json | wc -l) evaluated runs into $out"
  exit 0
fi
[ -f "$out/preregistration.json" ] || { echo "keep_runs.sh: $out holds no preregistration.json" >&2; exit 1; }
mkdir -p "$record" && cp "$out/preregistration.json" "$record/"
n=0
for summary in "$out"/runs/*/seed_*/eval/summary.json; do
  [ -f "$summary" ] || continue
  run=$(dirname "$(dirname "$summary")") && dest="$record/${run#"$out"/}"
  mkdir -p "$dest/eval"
  cp "$run"/{train_config.yaml,train_summary.json,metrics.jsonl} "$dest/"
  cp "$run"/eval/{summary.json,items.jsonl} "$dest/eval/"
  n=$((n + 1))
done
echo "kept $n evaluated runs of $out in $record"
