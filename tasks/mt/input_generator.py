"""English → Spanish verse pairs as fixed-shape batches of ids.

By default every batch has the same shape [N, max_len] on both sides, so the
trainer's `tf.function` traces the pipeline once (a retrace of a deep
pipeline costs minutes) and the partitioner's costs hold for every step.
Verses average half of max_len, though, so half of that compute is padding.
Length buckets (`bucket_upper_bounds`, `bucket_batch_sizes`) cut it: a
training pair goes to the first bucket whose bound fits both sides, each
bucket has its own fixed shape [N_b, bound_b] (one trace per bucket), and
the step → bucket → examples map stays a pure function of the step:

    cycle        = bucket ids, bucket b appearing S_b = E_b // N_b times,
                   spread evenly (one cycle ≈ one epoch)
    bucket(s)    = cycle[s mod |cycle|]
    local step j = (s div |cycle|)·S_b + (# of b in cycle[:s mod |cycle|])
    examples     = bucket b's examples at train_indices(j, N_b, E_b)

Tokenisation runs
once, at load time, with the joint SentencePiece model (`lingvo_pipe.tasks.mt.vocab`);
the arrays then stay in memory and the training order is the pure function
of the step that `InMemoryInputGenerator` computes.

A batch (all [N, max_len] unless noted):

    src_ids       source ids, EOS-terminated, PAD after
    src_paddings  1.0 at padded source positions
    tgt_ids       decoder inputs: BOS, y_0, …, y_{L-2}  (targets shifted right)
    tgt_labels    y_0, …, y_{L-1} = …, EOS              (what is predicted)
    tgt_paddings  1.0 at padded target positions
    tgt_text      [N] the raw Spanish reference (eval splits, for BLEU)

Too-long pairs (more than max_len pieces with EOS on either side): in
training they are dropped, so the model never learns from cut sentences; in
evaluation nothing is dropped (BLEU is over the whole held-out split) — the
source is cut, keeping its EOS, and the reference stays the full text.
`num_dropped` / `num_truncated` count them.
"""

from __future__ import annotations

import csv
from typing import Any, Callable, Sequence

from absl import logging
import numpy as np
import tensorflow as tf

from lingvo_pipe.core import base_input_generator
from lingvo_pipe.core.hyperparams import InstantiableParams
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.tasks import datasets
from lingvo_pipe.tasks.mt import vocab as vocab_lib

SPLITS = ('train', 'validation', 'test')  # TFDS's names.


def encode_pairs(vocab: vocab_lib.Vocab, sources: Sequence[str],
                 targets: Sequence[str], max_len: int,
                 drop_long: bool) -> tuple[dict[str, np.ndarray], int]:
  """Ids, shifted decoder inputs and paddings of text pairs.

  Args:
    vocab: the SentencePiece vocabulary.
    sources, targets: parallel texts.
    max_len: padded length of both sides, EOS included.
    drop_long: drop pairs longer than max_len (else cut the source, keeping
      EOS, and the target labels likewise).

  Returns:
    (arrays keyed as in the module docstring, without tgt_text; the number
    of pairs that were too long).
  """
  src = [vocab.encode(s, add_eos=False) for s in sources]
  tgt = [vocab.encode(t, add_eos=False) for t in targets]
  long = [len(s) >= max_len or len(t) >= max_len for s, t in zip(src, tgt)]
  keep = [i for i, is_long in enumerate(long) if not (drop_long and is_long)]
  n = len(keep)
  out = {name: np.full((n, max_len), vocab_lib.PAD_ID, np.int32)
         for name in ('src_ids', 'tgt_ids', 'tgt_labels')}
  for row, i in enumerate(keep):
    s = src[i][:max_len - 1] + [vocab_lib.EOS_ID]
    t = tgt[i][:max_len - 1] + [vocab_lib.EOS_ID]
    out['src_ids'][row, :len(s)] = s
    out['tgt_labels'][row, :len(t)] = t
    out['tgt_ids'][row, :len(t)] = [vocab_lib.BOS_ID] + t[:-1]
  out['src_paddings'] = (out['src_ids'] == vocab_lib.PAD_ID).astype(
      np.float32)
  out['tgt_paddings'] = (out['tgt_labels'] == vocab_lib.PAD_ID).astype(
      np.float32)
  out['keep'] = np.asarray(keep, np.int64)
  return out, sum(long)


class BibleTranslationInput(base_input_generator.InMemoryInputGenerator):
  """Batches of (English source, Spanish target) verse pairs of one split."""

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('split', 'train', f'Which split, one of {SPLITS}.')
    p.Define('max_len', 64, 'Padded length in pieces, EOS included, of both '
             'sides; ~97% of training pairs fit in 64 (mean ~33).')
    p.Define('source_language', 'en', 'Feature of the source text.')
    p.Define('target_language', 'es', 'Feature of the target text.')
    p.Define('vocab_path', '', 'SentencePiece model; "" = the prepared one '
             '(lingvo_pipe.tasks.mt.vocab.default_model_path()).')
    p.Define('bucket_upper_bounds', [], 'Training only: increasing padded '
             'lengths of the length buckets, the last = max_len; [] = one '
             'shape [batch_size, max_len].')
    p.Define('bucket_batch_sizes', [], 'Pairs per step of each bucket '
             '(about equal tokens: longer buckets, smaller batches); each a '
             'multiple of the pipeline\'s num_micro_batches.')
    p.Define('tsv_path', '', 'Optional UTF-8 TSV of "source<TAB>target" '
             'lines used instead of the prepared split (tests, other data).')
    return p

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    p = self.params
    if p.split not in SPLITS:
      raise base_input_generator.InputError(
          f'{p.name}: split is {p.split!r}; use one of {SPLITS}.')
    if not isinstance(p.max_len, int) or p.max_len < 2:
      raise base_input_generator.InputError(
          f'{p.name}: max_len must be an int ≥ 2 (a piece and EOS), got '
          f'{p.max_len!r}; set input.max_len, e.g. 64.')
    bounds, sizes = list(p.bucket_upper_bounds), list(p.bucket_batch_sizes)
    if bounds and (len(bounds) != len(sizes) or bounds != sorted(set(bounds))
                   or bounds[-1] != p.max_len or min(sizes) < 1):
      raise base_input_generator.InputError(
          f'{p.name}: bucket_upper_bounds {bounds} must increase and end at '
          f'max_len={p.max_len}, with one batch size ≥ 1 each in '
          f'bucket_batch_sizes {sizes}; e.g. [32, 48, {p.max_len}] and '
          '[128, 96, 64].')
    self.num_dropped = 0
    self.num_truncated = 0

  @property
  def is_training(self) -> bool:
    return self.params.split == 'train'

  def TrainBatchSizes(self) -> list[int]:
    """One per length bucket, or [batch_size] without buckets."""
    return list(self.params.bucket_batch_sizes) or [self.params.batch_size]

  def TrainBatchSpecs(self, element_spec: Any) -> list[tuple[int, Any]]:
    """One per length bucket: [N_b, bound_b] (or [N, max_len])."""
    p = self.params
    shapes = (list(zip(p.bucket_batch_sizes, p.bucket_upper_bounds)) or
              [(p.batch_size, p.max_len)])
    return [(n, tf.nest.map_structure(
        lambda s, n=n, t=t: tf.TensorSpec([n, t][:s.shape.rank], s.dtype),
        element_spec)) for n, t in shapes]

  def _Texts(self) -> tuple[list[str], list[str]]:
    p = self.params
    if p.tsv_path:
      with open(p.tsv_path, encoding='utf-8', newline='') as f:
        rows = [r for r in csv.reader(f, delimiter='\t',
                                      quoting=csv.QUOTE_NONE) if r]
      bad = [i for i, r in enumerate(rows) if len(r) != 2]
      if bad:
        raise base_input_generator.InputError(
            f'{p.name}: {p.tsv_path} line {bad[0] + 1} has {len(rows[bad[0]])}'
            ' fields; each line must be "source<TAB>target".')
      return [r[0] for r in rows], [r[1] for r in rows]
    data = datasets.load('bible_en_es', p.split)
    return list(data[p.source_language]), list(data[p.target_language])

  def LoadArrays(self) -> dict[str, np.ndarray]:
    p = self.params
    vocab = vocab_lib.Vocab(p.vocab_path or None)
    sources, targets = self._Texts()
    arrays, num_long = encode_pairs(vocab, sources, targets, p.max_len,
                                    drop_long=self.is_training)
    keep = arrays.pop('keep')
    arrays['tgt_text'] = np.array([targets[i] for i in keep], dtype=object)
    if self.is_training:
      self.num_dropped = num_long
    else:
      self.num_truncated = num_long
    logging.info('%s: %d %s pairs; %d longer than max_len=%d %s.', p.name,
                 len(keep), p.split, num_long, p.max_len,
                 'dropped' if self.is_training else 'cut (source) / kept')
    return arrays

  def Preprocess(self, batch: NestedMap, step: tf.Tensor | None) -> NestedMap:
    if step is not None:  # Training: the references are not needed.
      batch.pop('tgt_text', None)
    return batch

  # ---- Length buckets (training) --------------------------------------------
  def TrainDataset(self, start_step: int) -> tf.data.Dataset:
    if not self.params.bucket_upper_bounds:
      return super().TrainDataset(start_step)
    buckets = self._Buckets()
    steps = [len(idx) // n for _, n, idx in buckets]
    cycle = bucket_cycle(steps)
    before = np.stack([np.cumsum(cycle == b) - (cycle == b)
                       for b in range(len(buckets))])  # [buckets, |cycle|]
    cycle_t, before_t = tf.constant(cycle), tf.constant(before, tf.int64)
    steps_t = tf.constant(steps, tf.int64)
    gathers = [self._BucketGather(b, *bucket) for b, bucket in
               enumerate(buckets)]

    def batch(step: tf.Tensor) -> NestedMap:
      pos = step % len(cycle)
      b = cycle_t[pos]
      local = (step // len(cycle)) * steps_t[b] + before_t[b, pos]
      branches = [lambda g=g: g(local) for g in gathers]
      return self.Preprocess(tf.switch_case(tf.cast(b, tf.int32), branches),
                             step)

    ds = tf.data.Dataset.counter(start=int(start_step), dtype=tf.int64)
    ds = ds.map(batch, num_parallel_calls=tf.data.AUTOTUNE,
                deterministic=True)
    return ds.prefetch(tf.data.AUTOTUNE)

  def _Buckets(self) -> list[tuple[int, int, np.ndarray]]:
    """(bound, batch size, example indices) of every bucket."""
    p, arrays = self.params, self.Arrays()
    length = p.max_len - np.minimum(arrays['src_paddings'].sum(1),
                                    arrays['tgt_paddings'].sum(1))
    which = np.searchsorted(p.bucket_upper_bounds, length, side='left')
    out = []
    for b, (bound, n) in enumerate(zip(p.bucket_upper_bounds,
                                       p.bucket_batch_sizes)):
      idx = np.flatnonzero(which == b)
      if len(idx) < n:
        raise base_input_generator.InputError(
            f'{p.name}: bucket {b} (length ≤ {bound}) has {len(idx)} pairs, '
            f'fewer than its batch size {n}; lower bucket_batch_sizes[{b}] '
            'or merge it into the next bucket.')
      out.append((bound, n, idx))
    return out

  def _BucketGather(self, b: int, bound: int, n: int,
                    idx: np.ndarray) -> Callable[[tf.Tensor], NestedMap]:
    arrays = {k: v[idx][:, :bound] for k, v in self.Arrays().items()
              if k != 'tgt_text'}
    with tf.device('/device:CPU:0'):
      tensors = {k: tf.constant(v) for k, v in arrays.items()}
    seed = int(self.params.seed) + 7919 * b

    def gather(local_step: tf.Tensor) -> NestedMap:
      rows = base_input_generator.train_indices(local_step, n, len(idx), seed)
      return NestedMap({k: tf.gather(v, rows) for k, v in tensors.items()})

    return gather


def bucket_cycle(steps_per_epoch: Sequence[int]) -> np.ndarray:
  """Bucket ids, b appearing steps_per_epoch[b] times, spread evenly."""
  keys = sorted(((i + 0.5) / c, b) for b, c in enumerate(steps_per_epoch)
                for i in range(c))
  return np.array([b for _, b in keys], np.int64)
