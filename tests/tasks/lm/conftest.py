"""Tiny language-model fixtures: a SentencePiece model and a text file.

The English side of the translation tests' hand-written verses
(tests/tasks/mt/mt_testdata.py): nothing reads the prepared Bible data.
"""

from __future__ import annotations

import os
import sys

import pytest

from lingvo_pipe.tasks.mt import vocab

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'mt'))
# pylint: disable=g-import-not-at-top,wrong-import-position
from mt_testdata import PAIRS


@pytest.fixture(scope='session')
def lm_data(tmp_path_factory) -> dict[str, str]:
  """{'vocab': model path, 'text': one verse per line}."""
  root = tmp_path_factory.mktemp('lm')
  texts = [en for en, _ in PAIRS]
  model = vocab.train(texts * 4, root / 'lm.model', vocab_size=96,
                      hard_vocab_limit=False)
  text = root / 'verses.txt'
  text.write_text(''.join(f'{t}\n' for t in texts), encoding='utf-8')
  return {'vocab': str(model), 'text': str(text)}
