"""lingvo_pipe: GPipe pipeline parallelism for TensorFlow 2, in Lingvo's style.

Importing this package is cheap and imports nothing heavy: it defines
`__version__` and `LingvoPipeError` (the root of every error the library
raises on bad input), and arranges for the TFDS builders
(`lingvo_pipe_fashion_mnist`, `lingvo_pipe_bible_en_es`) to be registered when
TensorFlow Datasets is imported (see `_tfds_registration`), and keeps the
old import paths of moved modules working, with a warning (`_moved`).
Import what you use:

    from lingvo_pipe.core import gpipe          # PipeliningLayer
    from lingvo_pipe.layers import linear       # the layer library
    from lingvo_pipe.core import model_registry  # registered model configs
"""

from lingvo_pipe import _moved
from lingvo_pipe import _tfds_registration
from lingvo_pipe.errors import LingvoPipeError

__version__ = '0.1.0'
__all__ = ['LingvoPipeError', '__version__']

_tfds_registration.install()
_moved.install()  # Old import paths of moved modules keep working.
