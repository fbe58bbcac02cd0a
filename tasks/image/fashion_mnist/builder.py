"""TFDS builder of Fashion-MNIST from the Debian package's local files.

TFDS's own `fashion_mnist` downloads from a host our machines cannot reach and
checks upstream's gzip checksums, which Debian's files do not match. This
builder reads the IDX files of `dataset-fashion-mnist` (MIT licence) from
TFDS's manual directory and never downloads: 60,000 train and 10,000 test
28×28 grey images in 10 classes.

    tfds build lingvo_pipe_fashion_mnist --imports=lingvo_pipe \\
        --manual_dir=/usr/share/datasets/fashion-mnist

`python -m lingvo_pipe.tasks.prepare_data` does the same with the manual
directory it found or extracted (`data_paths.manual_dir`); tests point
`DownloadConfig(manual_dir=...)` at fixture files.
"""

from __future__ import annotations

import pathlib
from typing import Any, Iterator

import numpy as np
import tensorflow_datasets as tfds

from lingvo_pipe.tasks import data_paths
from lingvo_pipe.tasks.image.fashion_mnist import idx

_CITATION = """\
@article{xiao2017fashionmnist,
  author  = {Han Xiao and Kashif Rasul and Roland Vollgraf},
  title   = {Fashion-MNIST: a Novel Image Dataset for Benchmarking Machine
             Learning Algorithms},
  journal = {CoRR},
  volume  = {abs/1708.07747},
  year    = {2017},
  url     = {https://arxiv.org/abs/1708.07747},
}
"""

CLASS_NAMES = ('T-shirt/top', 'Trouser', 'Pullover', 'Dress', 'Coat',
               'Sandal', 'Shirt', 'Sneaker', 'Bag', 'Ankle boot')
_SPLIT_FILES = {
    'train': ('train-images-idx3-ubyte.gz', 'train-labels-idx1-ubyte.gz'),
    'test': ('t10k-images-idx3-ubyte.gz', 't10k-labels-idx1-ubyte.gz'),
}


class LingvoPipeFashionMnist(tfds.core.GeneratorBasedBuilder):
  """Fashion-MNIST read from local IDX files (see the module docstring)."""

  name = 'lingvo_pipe_fashion_mnist'
  VERSION = tfds.core.Version('1.1.0')
  RELEASE_NOTES = {
      '1.0.0': 'Built from Debian dataset-fashion-mnist.',
      '1.1.0': 'Citation and licence; the IDX files come from manual_dir.',
  }
  MANUAL_DOWNLOAD_INSTRUCTIONS = f"""\
  Put the four IDX files of Fashion-MNIST ({', '.join(
      data_paths.FASHION_MNIST_FILES)}) in the manual directory. Debian ships
  them in the package dataset-fashion-mnist (`sudo apt-get install
  dataset-fashion-mnist`, then --manual_dir=/usr/share/datasets/fashion-mnist),
  or run `python -m lingvo_pipe.tasks.prepare_data --datasets=fashion_mnist`,
  which extracts the package without root and builds this dataset.
  """

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
        citation=_CITATION,
        license='MIT',
    )

  def _split_generators(self, dl_manager: Any) -> dict[str, Iterator]:
    source = data_paths.checked_manual_dir(
        dl_manager, data_paths.FASHION_MNIST_FILES,
        self.MANUAL_DOWNLOAD_INSTRUCTIONS)
    return {split: self._generate_examples(source / images, source / labels)
            for split, (images, labels) in _SPLIT_FILES.items()}

  def _generate_examples(self, image_path: pathlib.Path,
                         label_path: pathlib.Path
                        ) -> Iterator[tuple[int, dict[str, Any]]]:
    images, labels = idx.read_split(image_path, label_path,
                                    num_classes=len(CLASS_NAMES))
    for i, (image, label) in enumerate(zip(images, labels)):
      yield i, {'image': image[:, :, None], 'label': int(label)}
