"""The SentencePiece vocabulary: ids convention, round trip, determinism."""

import numpy as np
import pytest

from lingvo_pipe.tasks import data_paths
from lingvo_pipe.tasks.mt import vocab


@pytest.fixture
def corpus(bible_verses):
  rows = [r for r in bible_verses if r[3] is not None]
  return [r[3] for r in rows] + [r[4] for r in rows]


@pytest.fixture
def model(tmp_path, corpus):
  return vocab.train(corpus * 3, tmp_path / 'v.model', vocab_size=120,
                     hard_vocab_limit=False)


def test_special_ids(model):
  v = vocab.Vocab(model)
  pieces = [v.id_to_piece(i) for i in range(4)]
  assert pieces == ['<pad>', '</s>', '<s>', '<unk>']
  assert (vocab.PAD_ID, vocab.EOS_ID, vocab.BOS_ID, vocab.UNK_ID) == (0, 1, 2,
                                                                      3)
  assert 4 < v.size <= 120


def test_round_trip(model, corpus):
  v = vocab.Vocab(model)
  for text in corpus + ['the earth and the heaven', 'Dios amó al mundo']:
    ids = v.encode(text)
    assert ids[-1] == vocab.EOS_ID and vocab.EOS_ID not in ids[:-1]
    assert vocab.PAD_ID not in ids
    assert v.decode(ids) == text
    assert v.decode(ids + [vocab.PAD_ID] * 3) == text
  assert vocab.UNK_ID in v.encode('Zq', add_eos=False)  # Unseen letters.


def test_encode_batch_pads_and_truncates(model):
  v = vocab.Vocab(model)
  texts = ['In the beginning God created the heaven and the earth.', 'Amen.']
  ids = v.encode_batch(texts, max_len=6)
  assert ids.shape == (2, 6) and ids.dtype == np.int32
  assert ids[0, -1] == vocab.EOS_ID  # Cut, but still ends in EOS.
  short = v.encode(texts[1])
  np.testing.assert_array_equal(ids[1, :len(short)], short)
  assert (ids[1, len(short):] == vocab.PAD_ID).all()


def test_training_is_deterministic(tmp_path, corpus, model):
  again = vocab.train(corpus * 3, tmp_path / 'again.model', vocab_size=120,
                      hard_vocab_limit=False)
  assert again.read_bytes() == model.read_bytes()


def test_missing_model_names_the_fix(tmp_path):
  with pytest.raises(data_paths.MissingDataError, match='prepare_data'):
    vocab.Vocab(tmp_path / 'absent.model')
