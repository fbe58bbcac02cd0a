"""lingvo_pipe: GPipe pipeline parallelism for TensorFlow 2, Lingvo style."""

from lingvo_pipe.errors import LingvoPipeError

__all__ = ['LingvoPipeError']
