"""Fashion-MNIST from Debian's `dataset-fashion-mnist`, as a TFDS dataset.

Importing this package registers the builder `lingvo_pipe_fashion_mnist`
(TFDS registers builders defined inside a package, not in a top-level module).
Load a split with `tasks.datasets.load('fashion_mnist', 'train')`.
"""

from lingvo_pipe.tasks.image.fashion_mnist.builder import CLASS_NAMES
from lingvo_pipe.tasks.image.fashion_mnist.builder import LingvoPipeFashionMnist

__all__ = ['CLASS_NAMES', 'LingvoPipeFashionMnist']
