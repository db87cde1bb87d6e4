#!/usr/bin/env bash
# The second held-out evaluation of TimeQA, with the commands docs/cli.md gives for your own data: a training
# folder (the train pages) and a held-out folder (the test pages, sharing no paragraph with it), each method trained
# with `tempokern train --format beir` and scored with `tempokern eval --format beir --split test`. Independent of
# the suite: nothing here goes through tempokern.suite.
#
#   bash benchmarks/timeqa_heldout.sh OUT            # resumable: a finished step's output is kept
#   METHODS="zero_shot ctd" MAX_STEPS=1 bash benchmarks/timeqa_heldout.sh OUT    # a smoke run
#
# Budget as the suite's full TimeQA run: 2 epochs of batch 32, 128 tokens, lr 5e-5 (LoRA 5e-4), mean pooling.
# `ctd` is the suite's `ctd_full`: overlap positives and calendar keys only (--positives overlap --calendar-labels
# key), not the per-dataset defaults of `tempokern train` (page-scoped positives, interval calendar targets).
# OUT/summary.json / summary.md: every row's metrics on the test split with 95% bootstrap intervals over questions
# and paired differences to full fine-tuning (`ft`) and LoRA fine-tuning (`lora`), from the rows' TREC runs
# (benchmarks/timeqa_heldout_summary.py).
set -euo pipefail
out=${1:?usage: timeqa_heldout.sh OUT}
mkdir -p "$out"
tk() { python -m tempokern "$@"; }
steps=${MAX_STEPS:+--max-steps $MAX_STEPS}
common="--format beir --backbone minilm --pooling mean --epochs 2 --batch-size 32 --max-length 128 --no-progress"
# no dev split in the training folder: every method trains its full budget and keeps the last weights (CTD would
# otherwise rank the dev questions over the folder's 11,331 paragraphs after each epoch to pick one)
[ -f "$out/train/corpus.jsonl" ] || tk data timeqa --out "$out/train" --splits train --negatives 1
[ -f "$out/test/corpus.jsonl" ] || tk data timeqa --out "$out/test" --splits test --negatives 1

for m in ${METHODS:-zero_shot ft lora tmrl ctd re3}; do
  run="$out/runs/$m"
  if [ ! -f "$out/eval-$m.json" ] || [ ! -f "$out/run-$m.trec" ]; then
    case $m in
      zero_shot) [ -d "$run/best" ] || tk train --method tmrl --variant zero_shot $common --data "$out/train" --out "$run" ;;
      ft)   [ -d "$run/best" ] || tk train --method ctd --variant baseline $common --lr 5e-5 $steps --data "$out/train" --out "$run" ;;
      ctd)  [ -d "$run/best" ] || tk train --method ctd --variant full $common --lr 5e-5 $steps --positives overlap --calendar-labels key --data "$out/train" --out "$run" ;;
      lora) [ -d "$run/best" ] || tk train --method tmrl --variant lora $common --lr 5e-4 $steps --data "$out/train" --out "$run" ;;
      tmrl) [ -d "$run/best" ] || tk train --method tmrl --variant tmrl $common --lr 5e-4 $steps --data "$out/train" --out "$run" ;;
      re3)  [ -d "$run/model" ] || tk train --method re3 --format beir --backbone minilm --pooling mean --max-length 128 --no-progress --data "$out/train" --out "$run" ;;
      *) echo "unknown method $m" >&2; exit 2 ;;
    esac
    model="$run/best"; [ -d "$model" ] || model="$run"
    extra=""; [ "$m" = re3 ] && extra="--method re3"
    tk eval $extra --model "$model" --format beir --data "$out/test" --split test --no-progress --out "$out/eval-$m.json" \
      --run-out "$out/run-$m.trec"
  fi
done
# read from stdin so that tempokern is imported as `python -m tempokern` finds it (installed, or the current folder)
python - "$out" < "$(dirname "$0")/timeqa_heldout_summary.py"
