"""The main of every `py_test` in tests/BUILD: runs its test files with pytest.

Bazel gives each test file its own target, and each directory's quick files
one more (`<dir>/quick`, run in one process: tests/BUILD says why); this
runs the target's files with the same pytest options as `pytest tests`, reports to
the JUnit XML file Bazel asks for, and keeps pytest's temporary files inside
the test's own scratch directory.
"""

import os
import sys

import pytest


def main(argv: list[str]) -> int:
  """Runs `pytest <test files> [pytest args]`; returns pytest's exit code."""
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  args = ['-q', *argv]
  xml_file = os.environ.get('XML_OUTPUT_FILE')
  if xml_file:
    args.append(f'--junitxml={xml_file}')
  scratch = os.environ.get('TEST_TMPDIR')
  if scratch:
    args.append(f'--basetemp={os.path.join(scratch, "pytest")}')
  return int(pytest.main(args))


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
