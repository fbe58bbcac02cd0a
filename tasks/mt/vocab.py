"""The joint English–Spanish SentencePiece vocabulary of the translation task.

One sub-word vocabulary serves both languages (shared embeddings, as in
GNMT and GPipe's Transformer), trained on the **training split only** so that
held-out books cannot shape the segmentation. It is trained once, at
data-preparation time, with a fixed seed on one thread, so the same data gives
the same model bytes, and saved as `<root>/vocab/bible_en_es.spm.model`.

Id convention (fixed in the model, so every consumer agrees):

    PAD_ID = 0   padding; batches are zero-padded
    EOS_ID = 1   ends every encoded sentence (source and target)
    BOS_ID = 2   starts decoder inputs (targets shifted right)
    UNK_ID = 3   pieces never seen in training

>>> v = Vocab()                         # the prepared model
>>> ids = v.encode('In the beginning')  # [..., EOS_ID]
>>> v.decode(ids)
'In the beginning'
"""

from __future__ import annotations

import io
import pathlib
from typing import Iterable, Sequence

import numpy as np

from lingvo_pipe import extras
from lingvo_pipe.tasks import data_paths

PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
DEFAULT_VOCAB_SIZE = 8000
DEFAULT_SEED = 1234
MODEL_NAME = 'bible_en_es.spm.model'


def default_model_path() -> pathlib.Path:
  """<root>/vocab/bible_en_es.spm.model."""
  return data_paths.vocab_dir() / MODEL_NAME


def train(sentences: Iterable[str], model_path: str | pathlib.Path,
          vocab_size: int = DEFAULT_VOCAB_SIZE, model_type: str = 'unigram',
          seed: int = DEFAULT_SEED,
          hard_vocab_limit: bool = True) -> pathlib.Path:
  """Trains a SentencePiece model on `sentences` and writes it to model_path.

  Args:
    sentences: Training text, one sentence each (both languages, train split
      only).
    model_path: Output file (parent directories are created).
    vocab_size: Number of pieces, including the 4 special ids.
    model_type: 'unigram' or 'bpe'.
    seed: Seed of SentencePiece's random generator (with one thread, training
      is deterministic).
    hard_vocab_limit: False lets a tiny corpus end with fewer pieces.

  Returns:
    model_path.
  """
  spm = _sentencepiece()
  model_path = pathlib.Path(model_path)
  model_path.parent.mkdir(parents=True, exist_ok=True)
  spm.set_random_generator_seed(seed)
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(list(sentences)),
      model_writer=model,
      vocab_size=vocab_size,
      model_type=model_type,
      character_coverage=1.0,  # Few characters; keep á, ñ, ¿ and æ all.
      pad_id=PAD_ID, eos_id=EOS_ID, bos_id=BOS_ID, unk_id=UNK_ID,
      input_sentence_size=0,  # Use every sentence...
      shuffle_input_sentence=False,  # ...in the given order.
      num_threads=1,
      hard_vocab_limit=hard_vocab_limit,
      minloglevel=2)
  tmp = model_path.with_suffix('.tmp')
  tmp.write_bytes(model.getvalue())
  tmp.replace(model_path)  # Atomic: a half-written model never exists.
  return model_path


def _sentencepiece():
  """The sentencepiece module (the `mt` extra), imported when first used."""
  return extras.require('sentencepiece', 'mt',
                          'The translation task\'s sub-word vocabulary')


class Vocab:
  """Encodes text to ids (ending in EOS) and back, with a trained model."""

  def __init__(self, model_path: str | pathlib.Path | None = None) -> None:
    """Args: model_path; None is `default_model_path()`.

    Raises:
      data_paths.MissingDataError: the model file does not exist.
    """
    path = pathlib.Path(model_path or default_model_path())
    if not path.is_file():
      raise data_paths.MissingDataError(
          f'SentencePiece model {path} not found. Train it with `python -m '
          'lingvo_pipe.tasks.prepare_data --datasets=bible_en_es` (it is trained on the '
          'training split when the dataset is prepared).')
    self._sp = _sentencepiece().SentencePieceProcessor(model_file=str(path))
    self.path = path

  @property
  def size(self) -> int:
    """Number of ids, including PAD, EOS, BOS and UNK."""
    return self._sp.get_piece_size()

  def id_to_piece(self, i: int) -> str:
    """The piece of id `i`, e.g. '<pad>' for PAD_ID or '▁the'."""
    return self._sp.id_to_piece(int(i))

  def pieces(self, text: str) -> list[str]:
    """The sub-word pieces of `text` (for inspection)."""
    return self._sp.encode(text, out_type=str)

  def encode(self, text: str, add_eos: bool = True) -> list[int]:
    """Ids of `text`, followed by EOS_ID unless add_eos is False."""
    ids = self._sp.encode(text)
    return ids + [EOS_ID] if add_eos else ids

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Text of `ids`, up to the first EOS; PAD and BOS are skipped."""
    out = []
    for i in (int(x) for x in ids):
      if i == EOS_ID:
        break
      if i not in (PAD_ID, BOS_ID):
        out.append(i)
    return self._sp.decode(out)

  def encode_batch(self, texts: Sequence[str], max_len: int) -> np.ndarray:
    """int32 [len(texts), max_len] ids, each row ending in EOS, PAD after.

    Sentences longer than max_len - 1 pieces are cut, keeping the final EOS.
    """
    out = np.full((len(texts), max_len), PAD_ID, np.int32)
    for row, text in enumerate(texts):
      ids = self._sp.encode(text)[:max_len - 1] + [EOS_ID]
      out[row, :len(ids)] = ids
    return out
