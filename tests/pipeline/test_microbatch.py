"""microbatch: split/concat on nests and the errors that name a fix."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from lingvo_pipe.pipeline import microbatch
from lingvo_pipe.pipeline.microbatch import MicroBatchError
from lingvo_pipe.core.nested_map import NestedMap


def _nest(n: int, batch_dim: int = 0) -> NestedMap:
  """Leaves whose entry i along batch_dim is identifiable (value i)."""
  x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
  y = np.arange(n, dtype=np.int32)
  z = np.arange(n * 2 * 2, dtype=np.float32).reshape(n, 2, 2)
  if batch_dim == 1:
    x, z = x.T, np.transpose(z, (1, 0, 2))
    y = y[None, :]
  return NestedMap(x=tf.constant(x), pair=(tf.constant(y), tf.constant(z)))


@pytest.mark.parametrize('batch_dim', [0, 1])
@pytest.mark.parametrize('m', [1, 2, 4, 8])
def test_split_concat_round_trip(batch_dim, m):
  nest = _nest(8, batch_dim)
  micro = microbatch.split(nest, m, batch_dim)
  assert len(micro) == m
  for k, piece in enumerate(micro):
    assert type(piece) is NestedMap and isinstance(piece.pair, tuple)
    # Micro-batch k holds examples k·n … k·n + n − 1 (a plain slice).
    n = 8 // m
    want = np.take(nest.x.numpy(), range(k * n, (k + 1) * n), axis=batch_dim)
    np.testing.assert_array_equal(piece.x.numpy(), want)
    assert piece.pair[1].shape[batch_dim] == n
  back = microbatch.concat(micro, batch_dim)
  tf.nest.assert_same_structure(back, nest)
  for a, b in zip(tf.nest.flatten(back), tf.nest.flatten(nest)):
    np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_batch_size_is_static_when_known_and_a_tensor_otherwise():
  assert microbatch.batch_size(_nest(8), 0, 'net') == 8
  assert microbatch.batch_size(_nest(8, 1), 1, 'net') == 8
  # Regression: numpy inputs (whose .shape is a tuple) raised
  # AttributeError: 'tuple' object has no attribute 'rank'.
  assert microbatch.batch_size([np.zeros([6, 2])], 0, 'net') == 6

  @tf.function(input_signature=[tf.TensorSpec([None, 3])])
  def dynamic(x):
    return microbatch.batch_size((x,), 0, 'net')

  assert int(dynamic(tf.zeros([5, 3]))) == 5


@pytest.mark.parametrize('inputs, batch_dim, match', [
    ((tf.zeros([8, 3]), tf.zeros([6, 3])), 0,
     r'disagree on the batch size along dim 0: \[6, 8\]'),
    ((tf.zeros([8, 3]), tf.constant(1.0)), 0,
     'input leaf 1 has shape \\(\\), which has no batch dimension 0'),
    ((tf.zeros([8]),), 1, 'no batch dimension 1.*set p.batch_dim'),
    ((), 0, 'no input tensors'),
])
def test_batch_size_errors(inputs, batch_dim, match):
  with pytest.raises(MicroBatchError, match=match) as e:
    microbatch.batch_size(inputs, batch_dim, 'net.pipe')
  assert str(e.value).startswith('net.pipe: ')


def test_num_micro_batches_accepts_divisors():
  for m in (1, 2, 3, 4, 6, 12):
    assert microbatch.num_micro_batches(12, m, None, 'net') == m
  assert microbatch.num_micro_batches(12, 1, 3, 'net') == 4
  assert microbatch.num_micro_batches(12, 4, 3, 'net') == 4  # Consistent.


@pytest.mark.parametrize('n, m, near', [(10, 4, 5), (12, 5, 4), (7, 3, 1)])
def test_not_divisible_suggests_the_nearest_divisor(n, m, near):
  with pytest.raises(MicroBatchError) as e:
    microbatch.num_micro_batches(n, m, None, 'net')
  msg = str(e.value)
  assert f'batch size {n} is not divisible by num_micro_batches={m}' in msg
  assert f'num_micro_batches={near}' in msg
  # The suggestion is a divisor no farther from m than any other.
  divisors = [d for d in range(1, n + 1) if n % d == 0]
  assert n % near == 0 and abs(near - m) == min(abs(d - m) for d in divisors)


@pytest.mark.parametrize('n, m, mbs, match', [
    (4, 8, None, r'num_micro_batches=8 exceeds the batch size 4; use '
     r'num_micro_batches ≤ 4'),
    (8, 0, None, 'num_micro_batches must be ≥ 1, got 0'),
    (10, 1, 4, 'batch size 10 is not a multiple of micro_batch_size=4'),
    (8, 1, 16, 'batch size 8 is not a multiple of micro_batch_size=16'),
    # Regression: a negative size gave a negative number of micro-batches.
    (8, 1, -2, 'micro_batch_size must be ≥ 1'),
    (8, 1, 0, 'micro_batch_size must be ≥ 1'),
    # Regression: micro_batch_size silently won over num_micro_batches.
    (8, 2, 2, 'gives num_micro_batches=4 .* num_micro_batches=2 is set too'),
])
def test_num_micro_batches_errors(n, m, mbs, match):
  with pytest.raises(MicroBatchError, match=match):
    microbatch.num_micro_batches(n, m, mbs, 'net')


def test_micro_batch_size_needs_a_static_batch():
  with pytest.raises(MicroBatchError, match='needs a static batch size'):
    microbatch.num_micro_batches(tf.constant(8), 1, 2, 'net')
  # num_micro_batches works with a dynamic batch (checked by tf.split).
  assert microbatch.num_micro_batches(tf.constant(8), 2, None, 'net') == 2


def test_concat_rejects_a_scalar_output_leaf():
  outs = [NestedMap(loss=tf.constant(1.0), y=tf.zeros([2, 3]))] * 2
  with pytest.raises(MicroBatchError,
                     match='leaf 0 is a scalar.*per-example losses'):
    microbatch.concat(outs, 0)


def test_concat_rejects_a_leaf_without_the_batch_dim():
  # Regression: a rank-1 leaf with batch_dim=1 hit tf.concat's own error.
  outs = [(tf.zeros([3]), tf.zeros([3, 2]))] * 2
  with pytest.raises(MicroBatchError, match='no batch dimension 1'):
    microbatch.concat(outs, 1)


def test_single_micro_batch_is_passed_through():
  nest = _nest(4)
  assert microbatch.split(nest, 1, 0) == [nest]
  assert microbatch.concat([nest], 0) is nest
