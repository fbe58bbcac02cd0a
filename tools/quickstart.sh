#!/usr/bin/env bash
# The main job, as README gives it: `bash tools/quickstart.sh`.
# Runs tools/setup.sh first (venv and data sets, quick when already done),
# then the main job below.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tools/setup.sh
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"

# The main job: train the default registered model (AmoebaNet-D on
# Fashion-MNIST, 2 pipeline stages on 2 logical CPU devices) and score its
# last checkpoint on the test split.
logdir="${LOGDIR:-logs/fashion_mnist}"
model=image.fashion_mnist.AmoebaNetGPipe
.venv/bin/python -m lingvo_pipe.trainer --model="$model" --logdir="$logdir" "$@"
.venv/bin/python -m lingvo_pipe.evaler --model="$model" --logdir="$logdir" \
  --eval_dataset=Test --mode=latest
echo "quickstart: scores in $logdir/eval_test/, TensorBoard scalars in $logdir/train/"
