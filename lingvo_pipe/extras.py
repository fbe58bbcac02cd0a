"""Optional dependencies: imported where used, named by their pip extra.

The core install (`pip install lingvo_pipe[cpu]` or `[gpu]`) carries only
what every model needs. Translation (`[mt]`: sacrebleu, sentencepiece),
pictures (`[plots]`: matplotlib) and TensorBoard (`[tensorboard]`) are
extras, and the code that needs one asks for it through `require`, so a
missing package is an error that says which extra installs it:

>>> require('json', 'none', 'This example').__name__
'json'
"""

from __future__ import annotations

import importlib
import types

from lingvo_pipe import errors


class MissingExtraError(errors.LingvoPipeError, ImportError):
  """An optional dependency is not installed; the message names the extra."""


def require(module: str, extra: str, needed_for: str) -> types.ModuleType:
  """Imports optional `module`, or raises MissingExtraError naming `extra`.

  Args:
    module: e.g. 'sentencepiece'.
    extra: the lingvo_pipe extra that installs it, e.g. 'mt'.
    needed_for: what needs it, e.g. 'The translation vocabulary'.
  """
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise MissingExtraError(
        f'{needed_for} needs the Python package {module!r}, which is not '
        f"installed ({e}); install it with pip install 'lingvo_pipe[{extra}]'."
    ) from None
