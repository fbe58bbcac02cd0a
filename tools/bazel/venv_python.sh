#!/bin/sh
# The Python interpreter of Bazel's py_binary/py_test targets: the project's
# virtualenv (.venv, made by tools/setup.sh), wherever the checkout lives.
# Bazel runs this file from a runfiles tree of symlinks; resolving them leads
# back to the source tree, and so to its .venv.
here="$(dirname "$(readlink -f "$0")")"
python="$here/../../.venv/bin/python"
if [ ! -x "$python" ]; then
  echo "venv_python.sh: no $python; run 'bash tools/setup.sh' first." >&2
  exit 1
fi
exec "$python" "$@"
