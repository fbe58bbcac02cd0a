"""Profiling pass: plumbing across layers, training context, costs, errors.

No timed assertions: the only comparisons of times are between layers whose
flops differ by ≥ 16×, which no scheduling noise on a shared CPU reverses.
"""

import gc
import weakref

import pytest
import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core import fprop_context
from lingvo_pipe.layers import embedding
from lingvo_pipe.layers import linear
from lingvo_pipe.layers import transformer
from lingvo_pipe.pipeline import microbatch
from lingvo_pipe.pipeline import partitioner
from lingvo_pipe.pipeline import profile
from lingvo_pipe.pipeline.profile import LayerProfile, ProfileError

WIDTHS = (128, 256, 512, 1024, 2048)


def _fc_stack(rows_in=128):
  ps, d = [], rows_in
  for w in WIDTHS:
    ps.append(linear.FCLayer.Params().Set(
        name=f'fc{w}', input_dim=d, output_dim=w, activation='RELU'))
    d = w
  return ps


def test_fc_stack_ranks_wide_layers_above_narrow_and_feeds_partition():
  # CPU time: other processes on a shared CI machine stretch wall time.
  profs = profile.profile_layers(
      _fc_stack(), profile.synthetic_inputs([[128, 128]]), 2, repeats=5,
      clock='cpu')
  assert [p.name for p in profs] == [f'fc{w}' for w in WIDTHS]
  # Exact sizes of one micro-batch of 64 rows, and of the weights.
  assert [p.out_bytes for p in profs] == [64 * w * 4 for w in WIDTHS]
  ins = (128,) + WIDTHS[:-1]
  assert [p.param_bytes for p in profs] == [
      (i * w + w) * 4 for i, w in zip(ins, WIDTHS)]
  # (A narrow layer's forward may be 0: less than an empty call's dispatch.)
  assert all(p.forward_s >= 0 and p.backward_s >= 0 for p in profs)
  # I (the input gradient) is part of the backward; W's share is the rest.
  assert all(0 <= p.input_grad_s <= p.backward_s for p in profs)
  assert all(0 <= p.weight_share <= 1 for p in profs)
  # fc1024 and fc2048 have ≥ 16× the flops of fc128 and fc256.
  for wide in profs[3:]:
    for narrow in profs[:2]:
      assert wide.total_s > narrow.total_s, (wide, narrow)
  costs = profile.costs_from_profiles(profs)
  assert costs == [p.total_s for p in profs]
  # fc2048 alone outweighs fc128 + fc256 + fc512 by ~10×: it gets a stage.
  assert partitioner.partition(costs, 2) == [0, 4, 5]


def test_transformer_tuple_outputs_feed_the_next_layer():
  ps = [transformer.TransformerEncoderLayer.Params().Set(
      name=f'enc{i}', input_dim=16, num_heads=2, hidden_dim=32)
        for i in range(2)]
  profs = profile.profile_layers(
      ps, profile.synthetic_inputs([[4, 6, 16], [4, 6]]), 2, repeats=1,
      warmup=0)
  # (x [2, 6, 16], paddings [2, 6]) per micro-batch, float32.
  assert [p.out_bytes for p in profs] == [(2 * 6 * 16 + 2 * 6) * 4] * 2
  assert profs[0].param_bytes == profs[1].param_bytes > 0


def test_int_inputs_embedding():
  ps = [embedding.EmbeddingLayer.Params().Set(name='emb', vocab_size=32,
                                              embedding_dim=8),
        linear.FCLayer.Params().Set(name='fc', input_dim=8, output_dim=4)]
  inputs = profile.synthetic_inputs([[4, 5]], [tf.int32])
  assert inputs[0].dtype == tf.int32 and not inputs[0].numpy().any()
  profs = profile.profile_layers(ps, inputs, 2, repeats=2, clock='cpu')
  assert [p.out_bytes for p in profs] == [2 * 5 * 8 * 4, 2 * 5 * 4 * 4]
  assert profs[0].param_bytes == 32 * 8 * 4


_SEEN = []  # What _Probe saw while traced: (context, input shape, device).
_ALIVE = []  # Weak references to every _Probe built.


class _Probe(base_layer.BaseLayer):
  """Records the fprop_context and inputs it is traced with."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 4, 'Depth.')
    return p

  def __init__(self, params):
    super().__init__(params)
    self.CreateVariable('w', base_layer.WeightParams([self.params.dim]))
    _ALIVE.append(weakref.ref(self))

  def FProp(self, theta, x):
    y = x * theta.w
    _SEEN.append((fprop_context.current(), x.shape.as_list(), y.device))
    return y


def test_training_context_one_micro_batch_device_and_freeing():
  _SEEN.clear()
  _ALIVE.clear()
  ps = [_Probe.Params().Set(name=f'p{i}') for i in range(2)]
  profile.profile_layers(ps, [tf.ones([12, 4])], 3, device='/device:CPU:1',
                         repeats=1)
  assert _SEEN, 'FProp never traced'
  for ctx, shape, device in _SEEN:
    assert ctx.training and ctx.num_micro_batches == 3
    assert shape == [4, 4]  # 12 rows / M=3.
    assert device.endswith('CPU:1')
  gc.collect()
  assert len(_ALIVE) == 2 and all(ref() is None for ref in _ALIVE)


def test_costs_with_transfer():
  profs = [LayerProfile('a', 1.0, 2.0, out_bytes=100, param_bytes=0),
           LayerProfile('b', 0.5, 0.5, out_bytes=10, param_bytes=0)]
  assert profile.costs_from_profiles(profs) == [3.0, 1.0]
  assert profile.costs_from_profiles(
      profs, include_transfer=True, bytes_per_second=100.0) == [5.0, 1.2]


def test_errors():
  fc = [linear.FCLayer.Params().Set(name='fc', input_dim=4, output_dim=4)]
  with pytest.raises(microbatch.MicroBatchError, match='not divisible'):
    profile.profile_layers(fc, [tf.ones([6, 4])], 4)
  with pytest.raises(ProfileError, match='layer_params is empty'):
    profile.profile_layers([], [tf.ones([6, 4])], 2)
  with pytest.raises(ProfileError, match='repeats=0'):
    profile.profile_layers(fc, [tf.ones([6, 4])], 2, repeats=0)
  with pytest.raises(ProfileError, match="clock='gpu'"):
    profile.profile_layers(fc, [tf.ones([6, 4])], 2, clock='gpu')
  assert sorted(profile.CLOCKS) == ['cpu', 'wall']
  with pytest.raises(ProfileError, match='unknown dimensions'):
    profile.synthetic_inputs([[None, 4]])
  with pytest.raises(ProfileError, match='input_dtypes has 2 entries'):
    profile.synthetic_inputs([[2, 4]], [tf.int32, tf.int32])
  with pytest.raises(ProfileError, match='profiles is empty'):
    profile.costs_from_profiles([])
  with pytest.raises(ProfileError, match='bytes_per_second=0'):
    profile.costs_from_profiles([LayerProfile('a', 1, 1, 1, 1)],
                                include_transfer=True, bytes_per_second=0)
