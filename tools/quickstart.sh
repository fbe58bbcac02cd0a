#!/usr/bin/env bash
# The main job, as README gives it: `bash tools/quickstart.sh`.
# Runs tools/setup.sh first (venv and data sets, quick when already done),
# then the main job below.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tools/setup.sh
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"

# The main job: one line.
main_job=(.venv/bin/python -m lingvo_pipe.trainer
          --model=synthetic.regression.MlpRegression --logdir=logs/quickstart)

if [[ -f lingvo_pipe/trainer.py ]]; then
  exec "${main_job[@]}"
fi
echo "trainer not built yet (no lingvo_pipe/trainer.py). Registered models:"
exec .venv/bin/python -c '
from lingvo_pipe.core import model_registry
for name in model_registry.ListModels():
  print(" ", name)'
