"""English–Spanish Bible verses (KJV / Reina-Valera 1909) as a TFDS dataset.

Importing this package registers the builder `lingvo_pipe_bible_en_es`
(TFDS registers builders defined inside a package, not in a top-level module).
Load a split with `tasks.datasets.load('bible_en_es', 'train')`.
"""

from lingvo_pipe.tasks.mt.bible_en_es.builder import DEV_BOOKS
from lingvo_pipe.tasks.mt.bible_en_es.builder import LingvoPipeBibleEnEs
from lingvo_pipe.tasks.mt.bible_en_es.builder import TEST_BOOKS
from lingvo_pipe.tasks.mt.bible_en_es.builder import aligned_pairs
from lingvo_pipe.tasks.mt.bible_en_es.builder import split_of

__all__ = ['DEV_BOOKS', 'LingvoPipeBibleEnEs', 'TEST_BOOKS', 'aligned_pairs',
           'split_of']
