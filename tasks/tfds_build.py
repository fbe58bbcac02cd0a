"""`tfds build`, without the rest of the `tfds` command.

    python -m lingvo_pipe.tasks.tfds_build lingvo_pipe_fashion_mnist \\
        --imports=lingvo_pipe --data_dir=DIR --manual_dir=DIR

takes exactly `tfds build`'s arguments and runs TFDS's own build command
(`tensorflow_datasets.scripts.cli.build`). It exists because the `tfds`
program of TFDS 4.9.9 and 4.9.10 imports every subcommand at start-up, and
two of them (convert_format, build_croissant) need `apache_beam` and
`mlcroissant`, which TFDS does not install; `build` needs neither. With
those packages installed, `tfds build ...` does the same thing.
"""

from __future__ import annotations

import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
  """Parses `tfds build` arguments from argv (sys.argv) and builds."""
  # pylint: disable=g-import-not-at-top
  from tensorflow_datasets.scripts.cli import build
  from tensorflow_datasets.scripts.cli import cli_utils

  import lingvo_pipe  # Registers our builders (also without --imports).
  del lingvo_pipe
  argv = list(sys.argv if argv is None else argv)
  parse = cli_utils.make_flags_parser(
      build.Args, description='tfds build (TFDS\'s build command alone).')
  parse(['tfds build'] + argv[1:]).execute()
  return 0


if __name__ == '__main__':
  from lingvo_pipe import _startup  # pylint: disable=g-import-not-at-top
  _startup.import_tensorflow(sys.argv)
  sys.exit(main())
