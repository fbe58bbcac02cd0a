"""What a run leaves for TensorBoard besides scalars (issue 12).

The params text summary (as Lingvo writes it), the partition report as
text, the HParams session, and --timeline_steps' Chrome trace and PNG of a
real training step.
"""

import json

from lingvo_pipe.core import summaries
from lingvo_pipe.pipeline import timeline

import binary_runner as br


def test_params_and_partition_report_are_text_summaries(trained_logdir):
  texts = summaries.read_texts(str(trained_logdir / 'train'))
  (step, params_text), = texts['params']
  assert step == 0
  lines = [l.strip() for l in params_text.splitlines()]
  assert lines == (trained_logdir / 'params.txt').read_text().splitlines()
  (_, report), = texts['pipeline/partition']
  assert 'stage' in report and 'imbalance' in report


def test_hparams_session_is_written_to_the_logdir(trained_logdir):
  tags = set()
  for path in trained_logdir.glob('events.out.tfevents.*'):
    for value in _summary_values(path):
      tags.add((value.tag, value.metadata.plugin_data.plugin_name))
  assert ('_hparams_/session_start_info', 'hparams') in tags


def _summary_values(path):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow.core.util import event_pb2  # pylint: disable=g-import-not-at-top
  for record in tf.data.TFRecordDataset(str(path)):
    yield from event_pb2.Event.FromString(record.numpy()).summary.value


def test_timeline_steps_draw_a_real_step(tmp_path, trained_logdir):
  logdir = tmp_path / 'logdir'
  rc, _, err = br.run(
      'trainer', f'--model={br.MODEL}', f'--logdir={logdir}', '--max_steps=30',
      '--timeline_steps=3',
      f'--model_params_override={br.FAST}; '
      'task.train.save_interval_steps: 10')
  assert rc == 0, err
  trace = json.loads((logdir / 'timeline' / 'step_3.trace.json').read_text())
  panels = {e['pid']: e['args']['name'] for e in trace['traceEvents']
            if e['name'] == 'process_name'}
  assert sorted(panels.values()) == ['measured', 'predicted (simulator)']
  measured = [e for e in trace['traceEvents'] if e['ph'] == 'X' and
              panels[e['pid']] == 'measured']
  # K=2 stages × M=4 micro-batches, each with a forward, a recompute and a
  # backward (recompute='always').
  ops = sorted((e['args']['stage'], e['args']['micro_batch'], e['cat'])
               for e in measured)
  assert ops == sorted((k, m, kind) for k in range(2) for m in range(4)
                       for kind in ('forward', 'recompute', 'backward'))
  png = (logdir / 'timeline' / 'step_3.png').read_bytes()
  assert png.startswith(b'\x89PNG')
  assert not (logdir / 'timeline' / 'step_4.png').exists()
  # The recorded step is a real training step: the same weights at the end.
  recorded = br.read_checkpoint(str(logdir / 'ckpt-30'))
  plain = br.read_checkpoint(str(trained_logdir / 'ckpt-30'))
  assert br.max_relative_diff(recorded, plain) == 0.0


def test_timeline_steps_needs_a_pipeline_and_positive_steps(tmp_path):
  rc, _, err = br.run('trainer', f'--model={br.MODEL}',
                      f'--logdir={tmp_path / "log"}', '--timeline_steps=0')
  assert rc == 2 and 'steps count from 1' in err, err
  rc, _, err = br.run('trainer', f'--model={br.MODEL}',
                      f'--logdir={tmp_path / "log"}', '--timeline_steps=x')
  assert rc == 2 and 'give step numbers' in err, err
  assert not (tmp_path / 'log').exists()


def test_records_from_a_trace_round_trip():
  recs = [timeline.Record(0, 0, 'F', 0.0, 1.0)]
  trace = timeline.to_chrome_trace([('measured', recs)])
  assert [e['name'] for e in trace['traceEvents'] if e['ph'] == 'X'] == ['F0']
