#!/usr/bin/env bash
# Makes a checkout ready to run and test, on Debian 12 with Python 3.11:
#
#   1. .venv (python3.11 -m venv) with lingvo_pipe installed editable, with
#      every extra the tests need (pip install -e "$EXTRAS", below: CPU
#      TensorFlow, translation, plots, TensorBoard, pytest; the benchmark's
#      optional peer, torch, is not: .venv/bin/pip install '.[peers]' adds it);
#   2. the data sets (python -m lingvo_pipe.tasks.prepare_data: Debian packages fetched
#      with apt-get download + dpkg -x, no root, then TFDS and vocabulary).
#
# Safe and quick to run again: pip runs only when pyproject.toml changed since
# the last install (its sha256 is stamped inside .venv), and prepare_data
# skips every step whose output exists. tools/test.sh and
# tools/quickstart.sh call this first.
#
# Environment: LINGVO_PIPE_PYTHON (default python3.11) makes the venv.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
venv_python=.venv/bin/python
extras='.[dev,cpu,mt,plots,tensorboard]'
stamp=.venv/lingvo_pipe_pyproject.sha256
pip_log=.venv/lingvo_pipe_pip.log

log() { echo "setup: $*" >&2; }
die() { echo "setup: ERROR: $*" >&2; exit 1; }

make_venv() {
  local python="${LINGVO_PIPE_PYTHON:-python3.11}"
  command -v "$python" >/dev/null || die "'$python' not found. lingvo_pipe" \
    "needs Python 3.11: apt-get install python3.11 python3.11-venv (or set" \
    "LINGVO_PIPE_PYTHON to a Python >= 3.11)."
  log "creating .venv with $python"
  "$python" -m venv .venv || die "'$python -m venv .venv' failed; on Debian" \
    "install the venv module (apt-get install python3.11-venv), then" \
    "rm -rf .venv and run this again."
}

install_package() {
  local want="$1"
  log "pip install -e '$extras' into .venv (the first time downloads" \
    "TensorFlow, a few minutes; log: $pip_log)"
  if ! "$venv_python" -m pip install --disable-pip-version-check -q \
      -e "$extras" >"$pip_log" 2>&1; then
    tail -n 20 "$pip_log" >&2
    die "pip install failed; the full log is $pip_log."
  fi
  echo "$want" >"$stamp"
}

main() {
  local want
  [[ -x "$venv_python" ]] || make_venv
  "$venv_python" -c 'import sys' 2>/dev/null || die ".venv is broken" \
    "('$venv_python' does not run); rm -rf .venv and run this again."
  want="$( (sha256sum pyproject.toml; echo "$extras") | sha256sum | cut -d' ' -f1)"
  if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    install_package "$want"
  fi
  if [[ -f tasks/prepare_data.py ]]; then
    "$venv_python" -m lingvo_pipe.tasks.prepare_data \
      || die "data preparation failed (python -m lingvo_pipe.tasks.prepare_data)."
  else
    log "tasks/prepare_data.py not there yet; skipping the data sets."
  fi
}

main
