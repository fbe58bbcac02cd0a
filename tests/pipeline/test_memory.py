"""Memory preflight: per-stage peaks by schedule, recompute, M; auto-M."""

import pytest

from lingvo_pipe.core import gpipe
from lingvo_pipe.core import optimizer
from lingvo_pipe.core.base_layer import LayerMeta
from lingvo_pipe.layers import linear
from lingvo_pipe.pipeline import actions
from lingvo_pipe.pipeline import memory
from lingvo_pipe.pipeline import schedule
from lingvo_pipe.pipeline.memory import MemoryBudgetError, PreflightError

MIB = 2**20


def _metas(num_layers, out_bytes, param_bytes=MIB):
  return [LayerMeta(0, (), param_bytes=param_bytes, out_bytes=out_bytes)
          ] * num_layers


def _activations(schedule, m, recompute='never', k=2, per_micro=MIB):
  """Stage activation peaks of 4 layers in K stages, micro-batch size fixed
  (the batch grows with M), each layer's output per_micro per micro-batch."""
  metas = _metas(4, m * per_micro)
  bounds = [0, 2, 4] if k == 2 else [0, 1, 2, 3, 4]
  pred = memory.predict(metas, bounds, m, input_bytes=m * per_micro,
                        schedule=schedule, recompute=recompute)
  return [s.activations for s in pred.stages]


def test_gpipe_grows_with_m_1f1b_is_bounded_by_k():
  for k in (2, 4):
    # Per micro-batch: each layer's output (1 MiB), and on stages s > 0 the
    # stage input (1 MiB; stage 0's is the whole-batch input, in io).
    per_micro = [(4 // k + (s > 0)) * MIB for s in range(k)]
    for m in (8, 16, 32):
      gpipe_act = _activations('gpipe', m, k=k)
      one_f_one_b = _activations('1f1b', m, k=k)
      # GPipe keeps every micro-batch's activations until its backward.
      assert gpipe_act == [m * a for a in per_micro]
      # 1F1B: stage s has at most K - s micro-batches in flight.
      assert one_f_one_b == [(k - s) * a for s, a in enumerate(per_micro)]
  assert _activations('1f1b', 32)[0] / _activations('gpipe', 32)[0] <= 0.25


def test_recompute_lowers_activations():
  never = _activations('gpipe', 8, 'never')
  always = _activations('gpipe', 8, 'always')
  except_last = _activations('gpipe', 8, 'except_last')
  # always: 8 saved stage inputs (stage 0's is the whole-batch input, in
  # io) + the rebuilt activations of one micro-batch.
  assert always == [2 * MIB, 8 * MIB + 2 * MIB]
  assert all(a < n for a, n in zip(always, never))
  assert except_last == [always[0], never[1]]


def test_components_and_optimizer_slots():
  metas = _metas(4, 8 * MIB, param_bytes=3 * MIB)
  for name, slots in (('sgd', 1), ('adam', 2), ('rmsprop', 2), (None, 0)):
    pred = memory.predict(metas, [0, 1, 4], 4, input_bytes=2 * MIB,
                          optimizer=name)
    assert [s.parameters for s in pred.stages] == [3 * MIB, 9 * MIB]
    assert [s.gradients for s in pred.stages] == [3 * MIB, 9 * MIB]
    assert [s.optimizer_slots for s in pred.stages] == [
        slots * 3 * MIB, slots * 9 * MIB]
  s0, s1 = pred.stages
  # Whole-batch input on stage 0; whole-batch output and its gradient last.
  assert (s0.io, s1.io) == (2 * MIB, 16 * MIB)
  # 2 × the largest activation per micro-batch + a micro-batch's gradient.
  assert s1.workspace == 2 * 2 * MIB + 9 * MIB
  assert s1.total == sum([s1.parameters, s1.gradients, s1.optimizer_slots,
                          s1.activations, s1.workspace, s1.io])
  assert pred.peak == s1.total and pred.fullest_stage == 1
  assert 'optimizer slots' in pred.to_text()
  one = memory.predict(metas, [0, 4], 1, input_bytes=2 * MIB)
  assert one.stages[0].workspace == 2 * 8 * MIB  # M=1: nothing accumulates.
  inside = memory.predict(metas, [0, 1, 4], 4, input_bytes=2 * MIB,
                          whole_batch_io=False)
  assert [s.io for s in inside.stages] == [0, 0]
  assert [s.transfers for s in inside.stages] == [0, 0]  # One process.


def test_stage_processes_hold_transfers_in_flight():
  # Counted off the action lists with transfers (actions.RECV_LOOKAHEAD =
  # 3): GPipe, K=2, M=4. Device 1 posts RECV_F0..3 before F0 (each 3
  # compute actions ahead of its reader, none before the first): 4 inputs
  # at once, + the input gradient it sends = 5 on its input side. Device 0
  # runs F0..F3, then R3+B3, R2+B2, … as one call each (calls 4, 5, 6, 7),
  # so it posts RECV_B3, B2, B1 before F1, F2, F3 and RECV_B0 before R3: 4
  # output gradients at once, + the output it sends = 5.
  assert actions.RECV_LOOKAHEAD == 3
  wired = schedule.gpipe_schedule(2, 4).with_transfers()
  assert [wired.transfer_buffers(s) for s in (0, 1)] == [
      {'input': 0, 'output': 5}, {'input': 5, 'output': 0}]
  # Boundary after layer 1 (8 MiB for the batch): 2 MiB per micro-batch.
  metas = _metas(4, 8 * MIB, param_bytes=3 * MIB)
  pred = memory.predict(metas, [0, 1, 4], 4, input_bytes=2 * MIB,
                        stage_processes=True)
  assert [s.transfers for s in pred.stages] == [5 * 2 * MIB, 5 * 2 * MIB]
  assert pred.stages[0].total == memory.predict(
      metas, [0, 1, 4], 4, input_bytes=2 * MIB).stages[0].total + 10 * MIB
  three = memory.predict(metas, [0, 1, 2, 4], 4, input_bytes=2 * MIB,
                         stage_processes=True)
  middle = schedule.gpipe_schedule(3, 4).with_transfers().transfer_buffers(1)
  assert three.stages[1].transfers == (  # Both sides.
      middle['input'] * 2 * MIB + middle['output'] * 2 * MIB)
  assert 'transfers' in pred.to_text()


def test_slot_counts_match_the_optimizers():
  """Guards against an optimizer gaining a slot the preflight forgets."""
  classes = {'sgd': optimizer.SgdMomentum, 'adam': optimizer.Adam,
             'rmsprop': optimizer.RmsProp}
  assert set(memory.OPTIMIZER_SLOTS) == set(optimizer.OPTIMIZERS)
  for name, cls in classes.items():
    assert memory.OPTIMIZER_SLOTS[name] == len(cls.SLOTS)


def test_from_fpropmeta_of_a_real_stack():
  layers = [linear.FCLayer.Params().Set(name=f'fc{i}', input_dim=64,
                                        output_dim=64) for i in range(4)]
  metas = gpipe.layer_metas(layers, [[32, 64]])
  pred = memory.predict(metas, [0, 2, 4], 4, input_bytes=32 * 64 * 4,
                        optimizer='adam')
  assert [s.parameters for s in pred.stages] == [2 * (64 * 64 + 64) * 4] * 2


def _auto(batch, budget, **kwargs):
  metas = _metas(4, batch * MIB // 16, param_bytes=MIB // 4)
  return memory.choose_micro_batches(metas, [0, 2, 4], batch, budget,
                                     input_bytes=batch * MIB // 16, **kwargs)


def _peak(batch, m, **kwargs):
  metas = _metas(4, batch * MIB // 16, param_bytes=MIB // 4)
  return memory.predict(metas, [0, 2, 4], m, input_bytes=batch * MIB // 16,
                        **kwargs).peak


def test_auto_prefers_m_of_4k_when_it_fits():
  # K=2: 4K = 8. The peak falls with M, so a budget that fits M=4 fits 8.
  assert _auto(64, _peak(64, 4)) == 8
  assert _auto(64, _peak(64, 1)) == 8
  # Only M ≥ 16 fits: the largest micro-batch that does.
  assert _auto(64, _peak(64, 16)) == 16
  assert _auto(64, (_peak(64, 16) + _peak(64, 8)) / 2) == 16


def test_auto_largest_micro_batch_when_no_m_of_4k_fits():
  # Batch 6: divisors 1, 2, 3, 6, none ≥ 8: the smallest M that fits.
  assert _auto(6, _peak(6, 3)) == 3
  assert _auto(6, _peak(6, 1)) == 1


def test_errors_name_stage_bytes_budget_and_fix():
  with pytest.raises(MemoryBudgetError) as e:
    _auto(64, _peak(64, 64) - 1)
  text = str(e.value)
  assert "num_micro_batches='auto'" in text and 'stage 1' in text
  assert 'even at M=64' in text and 'budget is' in text
  assert "schedule='1f1b'" in text and 'more stages' in text
  assert isinstance(e.value, ValueError)
  metas = _metas(4, 64 * MIB, param_bytes=MIB)
  with pytest.raises(MemoryBudgetError,
                     match=r'stage 1 is predicted to need 328 MiB .*budget '
                     r'is 100 MiB per stage.*M=2.*Fix: more micro-batches'):
    memory.check_budget(metas, [0, 2, 4], 2, 100 * MIB, input_bytes=MIB)
  with pytest.raises(MemoryBudgetError) as e:
    memory.check_budget(metas, [0, 2, 4], 2, 100 * MIB, input_bytes=MIB,
                        recompute='never')
  assert 'more micro-batches' not in str(e.value)  # GPipe, no recompute.
  assert "recompute='always'" in str(e.value)
  fits = memory.check_budget(metas, [0, 2, 4], 2, 10 * 2**30,
                             input_bytes=MIB)
  assert fits.num_micro_batches == 2


@pytest.mark.parametrize('kwargs, message', [
    (dict(optimizer='adagrad'), "optimizer='adagrad'"),
    (dict(schedule='zigzag'), 'zigzag'),
    (dict(recompute='sometimes'), 'sometimes'),
    (dict(boundaries=[0, 3]), 'boundaries'),
])
def test_bad_arguments(kwargs, message):
  args = dict(metas=_metas(4, MIB), boundaries=[0, 2, 4],
              num_micro_batches=2, input_bytes=MIB)
  args.update(kwargs)
  with pytest.raises(PreflightError, match=message):
    memory.predict(**args)
  with pytest.raises(PreflightError, match='budget_bytes=0'):
    memory.check_budget(_metas(4, MIB), [0, 2, 4], 2, 0, input_bytes=MIB)
  with pytest.raises(PreflightError, match='batch_size=0'):
    memory.choose_micro_batches(_metas(4, MIB), [0, 2, 4], 0, MIB,
                                input_bytes=MIB)


def test_split_backward_keeps_its_bytes_from_i_to_w():
  # One stage, M=1, zb_h1 (F, I, W): kept replaces the activations after I,
  # so the peak is max(activations, kept); kept counts only when given.
  metas = [LayerMeta(0, (), param_bytes=8, out_bytes=100)] * 2
  kw = dict(input_bytes=10, schedule='zb_h1', recompute='never',
            whole_batch_io=False)
  plain = memory.predict(metas, [0, 2], 1, **kw)
  assert plain.stages[0].activations == 10 + 200
  kept = memory.predict(metas, [0, 2], 1, layer_kept_bytes=[150, 150], **kw)
  assert kept.stages[0].activations == 300
  one = memory.predict(metas, [0, 2], 1, layer_kept_bytes=[150, 150],
                       **dict(kw, schedule='1f1b'))
  assert one.stages[0].activations == 210  # B does not split: no kept.
