#!/usr/bin/env bash
# The main job, as README gives it:
#   bash tools/quickstart.sh                    # 2 stage processes (default)
#   bash tools/quickstart.sh --single_process   # 1 process, 2 logical CPUs
# Any further arguments go to the trainer (e.g. --max_steps=100).
# Runs tools/setup.sh first (venv and data sets, quick when already done),
# then trains the default registered model (AmoebaNet-D on Fashion-MNIST,
# 2 pipeline stages) and scores its last checkpoint on the test split.
#
# By default each stage runs in a process of its own, pinned to a core of
# its own (`python -m lingvo_pipe.launch --num_stages=2`): the stages then
# really run at the same time, which logical devices of one process, sharing
# one thread pool, do not. The launcher picks free ports on 127.0.0.1 and
# stops both processes when one fails. The evaler reads the sharded
# checkpoint in one process.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
single=0
if [[ "${1:-}" == "--single_process" ]]; then
  single=1
  shift
fi
bash tools/setup.sh
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"

logdir="${LOGDIR:-logs/fashion_mnist}"
model=image.fashion_mnist.AmoebaNetGPipe
start=$SECONDS
if (( single )); then
  .venv/bin/python -m lingvo_pipe.trainer --model="$model" --logdir="$logdir" \
    "$@"
else
  .venv/bin/python -m lingvo_pipe.launch --num_stages=2 --num_replicas=1 -- \
    --model="$model" --logdir="$logdir" "$@"
fi
echo "quickstart: training took $((SECONDS - start)) s" \
  "($( (( single )) && echo 'one process' || echo '2 stage processes'))"
.venv/bin/python -m lingvo_pipe.evaler --model="$model" --logdir="$logdir" \
  --eval_dataset=Test --mode=latest
echo "quickstart: scores in $logdir/eval_test/, TensorBoard scalars in $logdir/train/"
