"""What the fork server of runtime_procs.py imports once for its children,
and what a child runs (`run_script`).

TensorFlow, quietly (`_startup`: no banner, no Keras pyplot), absl and the
pipeline modules the stand-in stage processes import, but no TensorFlow
context (a forked child must not inherit a thread pool) and no absl flags
(each script defines its own; `lingvo_pipe.launch` would define some too).
"""

import gc
import io
import os
import runpy
import sys

from lingvo_pipe import _startup

_startup.import_tensorflow(sys.argv)

# pylint: disable=g-import-not-at-top,unused-import,wrong-import-position
from absl import app
from absl import flags
import numpy
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core import gpipe
from lingvo_pipe.layers import transformer
from lingvo_pipe.pipeline import collective
from lingvo_pipe.pipeline import engine
from lingvo_pipe.pipeline import processes


def run_script(args, environ, cwd, out_path, err_path) -> None:
  """In the forked child: what `python script.py args…` does."""
  os.chdir(cwd)
  os.environ.clear()
  os.environ.update(environ)
  for fd, path in ((1, out_path), (2, err_path)):
    target = os.open(path, os.O_WRONLY | os.O_APPEND)
    os.dup2(target, fd)
    os.close(target)
  sys.stdout = io.TextIOWrapper(io.FileIO(1, 'w', closefd=False),
                                write_through=True, line_buffering=True)
  sys.stderr = io.TextIOWrapper(io.FileIO(2, 'w', closefd=False),
                                write_through=True, line_buffering=True)
  script = os.path.abspath(args[0])
  sys.argv = [script] + list(args[1:])
  sys.path.insert(0, os.path.dirname(script))
  runpy.run_path(script, run_name='__main__')


# A child's garbage collector then never walks the server's objects: it
# would write to (and so copy) every page they sit on.
gc.collect()
gc.freeze()
