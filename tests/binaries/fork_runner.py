"""Runs one binary many times, each run a child forked after the imports.

    python fork_runner.py trainer '[["--model=m", "--logdir=d"], ...]'

The second argument: a JSON list of argument lists (argv without the
program); stdout: a JSON list of [returncode, stdout, stderr], in order.
Two runs at a time.

Starting a binary is ~5 CPU-seconds, nearly all of it importing TensorFlow
and the binary's modules. Here they are imported once (as the console script
does: quietly, then the binary's module, whose flags are defined but not
parsed, and with no TensorFlow context yet, so no thread pool to fork), and
each run is a forked child that calls the same entry point
(`lingvo_pipe._entry.<binary>`) with its own `sys.argv`, file descriptors 1
and 2 going to files of its own. What is not covered is the start-up
itself: tests that use this keep a real subprocess per binary beside it.
"""

import importlib
import json
import os
import sys
import tempfile
import traceback

_PARALLEL = 2


def _child(binary, args, out, err):
  os.dup2(out.fileno(), 1)
  os.dup2(err.fileno(), 2)
  sys.argv = [binary, *args]
  code = 0
  try:
    getattr(importlib.import_module('lingvo_pipe._entry'), binary)()
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (e.code is not None)
    if isinstance(e.code, str):
      sys.stderr.write(e.code + '\n')
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
    code = 1
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
  os._exit(code)  # pylint: disable=protected-access


def _start(binary, args):
  out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
  pid = os.fork()
  if pid == 0:
    _child(binary, args, out, err)
  return pid, out, err


def _result(status, out, err):
  texts = []
  for f in (out, err):
    f.seek(0)
    texts.append(f.read().decode('utf-8', 'replace'))
    f.close()
  return [os.waitstatus_to_exitcode(status), *texts]


def main():
  binary = sys.argv[1]
  runs = json.loads(sys.argv[2])
  sys.path.insert(0, os.getcwd())  # As `python -m` would.
  from lingvo_pipe import _startup  # pylint: disable=g-import-not-at-top
  _startup.import_tensorflow([binary])
  importlib.import_module(f'lingvo_pipe.{binary}')
  results, running, todo = [None] * len(runs), {}, list(enumerate(runs))
  while todo or running:
    while todo and len(running) < _PARALLEL:
      i, args = todo.pop(0)
      pid, out, err = _start(binary, args)
      running[pid] = (i, out, err)
    pid, status = os.wait()
    i, out, err = running.pop(pid)
    results[i] = _result(status, out, err)
  json.dump(results, sys.stdout)


if __name__ == '__main__':
  main()
