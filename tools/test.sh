#!/usr/bin/env bash
# The test suite, as README gives it: `bash tools/test.sh [pytest args]`.
# Runs tools/setup.sh first (quick when already set up), then pytest with the
# project's virtualenv: on tests/, or on the files and directories given,
# e.g. `bash tools/test.sh tests/core -x`.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tools/setup.sh
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
targets=(tests)
for arg in "$@"; do
  if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
    targets=()  # The caller named what to run.
    break
  fi
done
exec .venv/bin/python -m pytest "${targets[@]}" -q "$@"
