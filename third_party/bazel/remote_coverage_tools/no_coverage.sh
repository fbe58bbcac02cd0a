#!/bin/sh
echo "bazel coverage is not supported by this offline workspace; run" \
  "'.venv/bin/python -m pytest tests' for tests (no coverage tool is set up)." >&2
exit 1
