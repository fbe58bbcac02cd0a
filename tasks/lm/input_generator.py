"""The Bible's English verses as blocks of tokens for a language model.

The corpus is the one `bible_en_es` prepares (KJV verses, whole books held
out for validation and test), English side only, tokenised with its joint
SentencePiece vocabulary. A split becomes one stream, verses in book order,
each followed by EOS, and the stream is cut into blocks of `max_len`
tokens; a block is one example:

    ids          stream[i·L : (i+1)·L]          what the model reads
    labels       stream[i·L + 1 : (i+1)·L + 1]  the next token of each
    paddings     1.0 past the stream's end (the last eval block only)

so every batch is [N, L] (one trace, static shapes on stage processes) and
no compute is spent on padding: verses average ~30 pieces, and padding each
to a fixed length would waste half of every step. A token's context is the
block it is in; every token of a split but the first is predicted once, so
the evaler's perplexity is the split's per-token perplexity. Training drops
the stream's last partial block, evaluation keeps it, padded.
"""

from __future__ import annotations

import numpy as np

from lingvo_pipe.core import base_input_generator
from lingvo_pipe.core.hyperparams import InstantiableParams
from lingvo_pipe.tasks import datasets
from lingvo_pipe.tasks.mt import vocab as vocab_lib

SPLITS = ('train', 'validation', 'test')


def blocks(stream: np.ndarray, length: int,
           keep_partial: bool) -> dict[str, np.ndarray]:
  """ids, labels and paddings [N, length] of a token stream (see above).

  >>> out = blocks(np.arange(8), 3, keep_partial=True)
  >>> out['ids'].tolist(), out['labels'].tolist()
  ([[0, 1, 2], [3, 4, 5], [6, 0, 0]], [[1, 2, 3], [4, 5, 6], [7, 0, 0]])
  >>> out['paddings'][-1].tolist()
  [0.0, 1.0, 1.0]
  """
  targets = len(stream) - 1  # Every token but the first is predicted.
  n = -(-targets // length) if keep_partial else targets // length
  ids = np.full((n, length), vocab_lib.PAD_ID, np.int32)
  labels = np.full((n, length), vocab_lib.PAD_ID, np.int32)
  paddings = np.ones((n, length), np.float32)
  for i in range(n):
    count = min(length, targets - i * length)
    ids[i, :count] = stream[i * length:i * length + count]
    labels[i, :count] = stream[i * length + 1:i * length + count + 1]
    paddings[i, :count] = 0.0
  return {'ids': ids, 'labels': labels, 'paddings': paddings}


class BibleLmInput(base_input_generator.InMemoryInputGenerator):
  """Blocks of English verses of one split (see the module docstring)."""

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('split', 'train', f'Which split, one of {SPLITS}.')
    p.Define('max_len', 128, 'Tokens per block: the context the model sees '
             '(about four verses).')
    p.Define('language', 'en', 'Feature of bible_en_es to read.')
    p.Define('vocab_path', '', 'SentencePiece model; "" = the prepared one '
             '(lingvo_pipe.tasks.mt.vocab.default_model_path()).')
    p.Define('text_path', '', 'Optional UTF-8 file, one verse per line, read '
             'instead of the prepared split (tests, other text).')
    return p

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    p = self.params
    if p.split not in SPLITS:
      raise base_input_generator.InputError(
          f'{p.name}: split is {p.split!r}; use one of {SPLITS}.')
    if not isinstance(p.max_len, int) or p.max_len < 2:
      raise base_input_generator.InputError(
          f'{p.name}: max_len must be an int ≥ 2, got {p.max_len!r}; set '
          'input.max_len, e.g. 128.')

  def _Texts(self) -> list[str]:
    p = self.params
    if p.text_path:
      with open(p.text_path, encoding='utf-8') as f:
        return [line.strip() for line in f if line.strip()]
    data = datasets.load('bible_en_es', p.split)
    order = np.lexsort((data['verse'], data['chapter'], data['book']))
    return [str(data[p.language][i]) for i in order]

  def LoadArrays(self) -> dict[str, np.ndarray]:
    p = self.params
    vocab = vocab_lib.Vocab(p.vocab_path or None)
    stream = [vocab_lib.EOS_ID]  # The first verse's context: a verse end.
    for text in self._Texts():
      stream += vocab.encode(text, add_eos=False) + [vocab_lib.EOS_ID]
    return blocks(np.asarray(stream, np.int32), p.max_len,
                  keep_partial=p.split != 'train')
