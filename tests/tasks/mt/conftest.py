"""Tiny translation fixtures: a SentencePiece model and TSV splits.

Nothing here reads the prepared Bible data or the network: the vocabulary is
trained on the sentence pairs below (written for these tests), so every test
of `lingvo_pipe.tasks.mt` runs on a fresh machine in seconds.
"""

from __future__ import annotations

import os
import sys

import pytest

from lingvo_pipe.tasks.mt import vocab

sys.path.insert(0, os.path.dirname(__file__))
# pylint: disable=g-import-not-at-top,wrong-import-position
from mt_testdata import LONG_PAIR, PAIRS, write_tsv


@pytest.fixture(scope='session')
def mt_data(tmp_path_factory) -> dict[str, str]:
  """{'vocab': model path, 'train': TSV, 'dev': TSV (has LONG_PAIR)}."""
  root = tmp_path_factory.mktemp('mt')
  texts = [t for pair in PAIRS + [LONG_PAIR] for t in pair]
  model = vocab.train(texts * 2, root / 'mt.model', vocab_size=160,
                      hard_vocab_limit=False)
  return {
      'vocab': str(model),
      'train': str(write_tsv(root / 'train.tsv', PAIRS + [LONG_PAIR])),
      'dev': str(write_tsv(root / 'dev.tsv', PAIRS[:5] + [LONG_PAIR] +
                           PAIRS[5:10])),
  }


@pytest.fixture(scope='session')
def mt_vocab(mt_data) -> vocab.Vocab:
  return vocab.Vocab(mt_data['vocab'])


@pytest.fixture
def tiny_task_params(mt_data, mt_vocab):
  """Factory of TranslationTask Params: d=16, 2 heads, 2+2 layers."""
  from lingvo_pipe.tasks.mt import model  # pylint: disable=g-import-not-at-top

  def make(batch_size=4, max_len=16, num_stages=2, num_micro_batches=2,
           dropout_prob=0.0, fprop_dtype=None, **task_values):
    p = model.TranslationTask.Params().Set(
        name='mt', vocab_path=mt_data['vocab'], max_decode_len=max_len,
        **task_values)
    p.pipeline.Set(
        name='net',
        layers=model.transformer_layers(
            mt_vocab.size, model_dim=16, num_heads=2, hidden_dim=32,
            num_encoder_layers=2, num_decoder_layers=2,
            dropout_prob=dropout_prob, atten_dropout_prob=dropout_prob,
            fprop_dtype=fprop_dtype),
        num_stages=num_stages, num_micro_batches=num_micro_batches,
        input_shapes=model.input_shapes(batch_size, max_len))
    return p

  return make
