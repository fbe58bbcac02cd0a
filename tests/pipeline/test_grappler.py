"""Grappler optimises each stage body once, not once per micro-batch.

Grappler's function optimizer gives a call with a constant input its own
specialised, separately optimised copy of the called function. Stage bodies
are called once per (stage, op, micro-batch); when the loss seeds and the
first gradient accumulator were constants, every backward of the last stage
was specialised: the first call of a step grew ∝ M (22 s instead of 8 s
for a 12-layer Transformer at M=32). TensorFlow logs each specialisation;
this test counts them in a fresh process.

Emitted op by op, there must be far fewer than M. In a loop over the
steady state (`p.loop_steady_state`) a call site stands for many
micro-batches; Grappler may still specialise a few of them (a loop body's
calls take loop variables and control inputs), but their number must not
grow with M.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_M = 8
_SCRIPT = textwrap.dedent('''
    import sys
    import tensorflow as tf
    cpu = tf.config.list_physical_devices('CPU')[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    from lingvo_pipe.core import fprop_context, gpipe
    from lingvo_pipe.layers import linear
    form, m, loop = sys.argv[1], int(sys.argv[2]), sys.argv[3] == 'loop'
    layers = [linear.FCLayer.Params().Set(name=f'fc{i}', input_dim=4,
                                          output_dim=4, activation='TANH')
              for i in range(4)]
    net = gpipe.PipeliningLayer.Params().Set(
        name='net', layers=layers, num_stages=2, num_micro_batches=m,
        devices=['/device:CPU:0', '/device:CPU:1'], input_shapes=[[8 * m, 4]],
        schedule='gpipe' if form == 'fprop' else form,
        loop_steady_state=loop).Instantiate()
    x, labels = tf.ones([8 * m, 4]), tf.zeros([8 * m])

    def loss_fn(y, labels):
      return {'loss': (tf.reduce_mean(tf.square(y)), tf.constant(1.0))}

    @tf.function
    def step():
      with tf.GradientTape() as tape:
        with fprop_context.scope(training=True, step=0):
          if form == 'fprop':
            loss = tf.reduce_mean(tf.square(net.FProp(net.theta, x)))
          else:
            loss = net.FPropLoss(net.theta, (x,), labels, loss_fn)['loss'][0]
      return tape.gradient(loss, net.trainable_variables)

    step()
    print('step done', flush=True)
''')


def _specialised(form: str, m: int, loop: bool) -> list[str]:
  """The stage calls Grappler specialised in one step, in a fresh process."""
  env = dict(os.environ, TF_CPP_VMODULE='function_optimizer=2',
             TF_CPP_MIN_LOG_LEVEL='0', CUDA_VISIBLE_DEVICES='')
  run = subprocess.run(
      [sys.executable, '-c', _SCRIPT, form, str(m), 'loop' if loop else '-'],
      env=env, capture_output=True, text=True, timeout=300, check=False)
  assert run.returncode == 0 and 'step done' in run.stdout, run.stderr[-3000:]
  log = run.stderr
  # The count below means something only if the optimizer's log is on and
  # still speaks of specialisation ("Specialize function call", "Skip
  # function specialization").
  assert 'function_optimizer.cc' in log and 'pecializ' in log, log[-3000:]
  return [line.split('{{node ')[1].split('}}')[0] for line in log.splitlines()
          if 'Specialize function call' in line]


@pytest.mark.parametrize('form', ['gpipe', '1f1b', 'fprop'])
def test_stage_bodies_are_not_specialised_per_micro_batch(form):
  calls = _specialised(form, _M, loop=False)
  # 2·K·M stage calls (F, fused R+B); one specialisation per micro-batch
  # would be ≥ M.
  assert len(calls) < _M // 2, calls


@pytest.mark.parametrize('form', ['gpipe', '1f1b', 'fprop'])
def test_looped_specialisations_do_not_grow_with_m(form):
  few, many = (_specialised(form, m, loop=True) for m in (_M, 4 * _M))
  assert len(many) <= len(few) + 2, (few, many)
