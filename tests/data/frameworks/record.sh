#!/usr/bin/env bash
# Re-record the framework corpus: run each framework for real (2 ranks under torchrun, gloo, CPU) and
# keep what a rank's log file gets, plus the metric files the framework wrote.
#
#   tests/data/frameworks/record.sh [NODE_ENV] [TRANSFORMERS4_PATH]
#
# NODE_ENV: the node training env (default .venv-node) with transformers 5, accelerate,
# pytorch-lightning, rich and tensorboard (bin/setup --node-env installs them).
# TRANSFORMERS4_PATH: a directory with transformers 4.x installed by
#   pip install --target DIR "transformers==4.57.*" "huggingface-hub<1.0" "tokenizers<0.23"
# put first on PYTHONPATH for the 4.x recording (skipped when not given).
# ONLY=NAME records just that one.
# After recording, run `.venv/bin/python tests/data/frameworks/expected.py` to rewrite each
# expected.json from what UGRO now reads, then READ THE DIFF: the expected files are the test.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
env=${1:-$repo/.venv-node}
tf4=${2:-}
torchrun="$env/bin/torchrun"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

record() {  # record NAME [ENV=VALUE ...] -- SCRIPT ARGS...
  local name=$1; shift
  if [ -n "${ONLY:-}" ] && [ "$ONLY" != "$name" ]; then return 0; fi
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  local out="$here/$name"
  rm -rf "$out" "$work/$name"
  mkdir -p "$out" "$work/$name"
  (cd "$work/$name" && env "${envs[@]}" PYTHONUNBUFFERED=1 UGRO_JOB_NAME="$name" \
    "$torchrun" --standalone --nproc-per-node 2 "$here/$1" "${@:2}" > "$out/rank_0.log" 2>&1)
  # keep the metric files the run wrote (Lightning's CSVLogger and TensorBoardLogger)
  (cd "$work/$name" && find . \( -name metrics.csv -o -name 'events.out.tfevents.*' \) -print0 |
    while IFS= read -r -d '' f; do mkdir -p "$out/$(dirname "$f")"; cp "$f" "$out/$f"; done)
  # the log names the machine's paths: make them the same on every re-recording
  sed -i "s#$env#NODE_ENV#g; s#$here#FRAMEWORKS#g; s#$work/$name#WORKDIR#g" "$out/rank_0.log"
  echo "recorded $name: $(wc -c < "$out/rank_0.log") bytes"
}

record hf5_trainer -- hf_trainer.py --max-steps 30 --logging-steps 5 --eval-steps 10
record hf5_seq2seq -- hf_trainer.py --seq2seq --max-steps 20 --logging-steps 5 --eval-steps 10
if [ -n "$tf4" ]; then
  record hf4_trainer "PYTHONPATH=$tf4" -- hf_trainer.py --max-steps 30 --logging-steps 5 --eval-steps 10
fi
record lightning_tqdm -- lightning_train.py --bar tqdm --epochs 2 --batches 20 --log-every 5
record lightning_rich -- lightning_train.py --bar rich --epochs 2 --batches 20 --log-every 5
# rich as it draws on a terminal (or wherever TTY_INTERACTIVE forces it): live redraws with cursor moves
record lightning_rich_live TTY_INTERACTIVE=1 TTY_COMPATIBLE=1 -- lightning_train.py --bar rich --epochs 2 \
  --batches 6 --log-every 2
# written to a log file (not a terminal), at a model's pace of 1, 10 and 100 steps a second
record lightning_tqdm_1sps -- lightning_train.py --bar tqdm --epochs 2 --batches 6 --log-every 2 --step-sleep 1
record lightning_rich_1sps -- lightning_train.py --bar rich --epochs 2 --batches 6 --log-every 2 --step-sleep 1
record lightning_tqdm_10sps -- lightning_train.py --bar tqdm --epochs 2 --batches 30 --log-every 5 --step-sleep 0.1
record lightning_rich_10sps -- lightning_train.py --bar rich --epochs 2 --batches 30 --log-every 5 --step-sleep 0.1
record lightning_tqdm_100sps -- lightning_train.py --bar tqdm --epochs 2 --batches 150 --log-every 10 --step-sleep 0.01
record lightning_rich_100sps -- lightning_train.py --bar rich --epochs 2 --batches 150 --log-every 10 --step-sleep 0.01
record accelerate_loop -- accelerate_loop.py --epochs 2 --steps-per-epoch 20 --log-every 5
