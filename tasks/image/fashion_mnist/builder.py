"""TFDS builder of Fashion-MNIST from the Debian package's local files.

TFDS's own `fashion_mnist` downloads from a host our machines cannot reach and
checks upstream's gzip checksums, which Debian's files do not match. This
builder reads the IDX files of `dataset-fashion-mnist` (MIT licence) from disk
and never downloads: 60,000 train and 10,000 test 28×28 grey images in 10
classes.

    builder = LingvoPipeFashionMnist(data_dir=data_paths.tfds_dir())
    builder.download_and_prepare()  # Reads <source_dir>/*-ubyte.gz.

`source_dir` defaults to where `tasks.data_paths` finds the package; tests
point it at fixture files.
"""

from __future__ import annotations

import pathlib
from typing import Any, Iterator

import numpy as np
import tensorflow_datasets as tfds

from lingvo_pipe.tasks import data_paths
from lingvo_pipe.tasks.image.fashion_mnist import idx

CLASS_NAMES = ('T-shirt/top', 'Trouser', 'Pullover', 'Dress', 'Coat',
               'Sandal', 'Shirt', 'Sneaker', 'Bag', 'Ankle boot')
_SPLIT_FILES = {
    'train': ('train-images-idx3-ubyte.gz', 'train-labels-idx1-ubyte.gz'),
    'test': ('t10k-images-idx3-ubyte.gz', 't10k-labels-idx1-ubyte.gz'),
}


class LingvoPipeFashionMnist(tfds.core.GeneratorBasedBuilder):
  """Fashion-MNIST read from local IDX files (see the module docstring)."""

  name = 'lingvo_pipe_fashion_mnist'
  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Built from Debian dataset-fashion-mnist.'}

  def __init__(self, *, source_dir: str | pathlib.Path | None = None,
               **kwargs: Any) -> None:
    """Args: source_dir holds the four IDX .gz files; kwargs go to TFDS."""
    self._source_dir = pathlib.Path(source_dir) if source_dir else None
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=('Fashion-MNIST (Zalando): 28×28 grey images of 10 kinds '
                     'of clothing; from the Debian package '
                     'dataset-fashion-mnist, MIT licence.'),
        features=tfds.features.FeaturesDict({
            'image': tfds.features.Image(shape=(28, 28, 1), dtype=np.uint8),
            'label': tfds.features.ClassLabel(names=CLASS_NAMES),
        }),
        supervised_keys=('image', 'label'),
        homepage='https://github.com/zalandoresearch/fashion-mnist',
    )

  def _split_generators(self, dl_manager: Any) -> dict[str, Iterator]:
    del dl_manager  # Local files only: nothing is downloaded.
    source = self._source_dir or data_paths.require('fashion_mnist')[
        'dataset-fashion-mnist']
    return {split: self._generate_examples(source / images, source / labels)
            for split, (images, labels) in _SPLIT_FILES.items()}

  def _generate_examples(self, image_path: pathlib.Path,
                         label_path: pathlib.Path
                        ) -> Iterator[tuple[int, dict[str, Any]]]:
    images, labels = idx.read_split(image_path, label_path,
                                    num_classes=len(CLASS_NAMES))
    for i, (image, label) in enumerate(zip(images, labels)):
      yield i, {'image': image[:, :, None], 'label': int(label)}
