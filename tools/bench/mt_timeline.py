"""Issue 26's picture: one TransformerSmall step on 2 stage processes.

The trainer's own `--timeline_steps` on a cluster, as a user runs it:

    python -m lingvo_pipe.launch --num_stages=2 -- \\
        --model=mt.bible_en_es.TransformerSmall --logdir=... \\
        --max_steps=S --timeline_steps=S

Each task records its own stage's ops; the chief merges them into one
picture (measured above predicted) and one Chrome trace, copied here to
docs/. S is the second step of the longest length bucket, and the first is
recorded too (`--timeline_steps=F,S`): the recorded step function is traced
per shape, and no two steps in a row share the longest bucket, so this is
what warms it up on that shape. With --tiny: step 2 of one bucket of 8
pairs (one trace, small steps).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from bench import common
from lingvo_pipe.pipeline import timeline

MODEL = 'mt.bible_en_es.TransformerSmall'
PNG = 'timeline_mt_k2.png'
TRACE = 'timeline_mt_k2.trace.json'


_TINY = 'input.bucket_upper_bounds: [64]; input.bucket_batch_sizes: [8]; '


def _recorded_steps() -> tuple[int, int, tuple[int, int]]:
  """(1-based warm-up step, step to picture, their bucket's (length,
  pairs)): the longest bucket's first two steps."""
  from lingvo_pipe.core import model_registry  # pylint: disable=g-import-not-at-top
  from lingvo_pipe.tasks.mt import input_generator  # pylint: disable=g-import-not-at-top
  gen = model_registry.get_params(MODEL, 'Train').input.Instantiate()
  buckets = gen._Buckets()  # pylint: disable=protected-access
  cycle = input_generator.bucket_cycle([len(i) // n for _, n, i in buckets])
  longest = [s + 1 for s, b in enumerate(cycle) if b == len(buckets) - 1]
  if len(longest) < 2:
    raise RuntimeError('the longest bucket comes up less than twice a cycle')
  return longest[0], longest[1], buckets[-1][:2]


def run(args: argparse.Namespace) -> dict[str, Any]:
  warm, step, (length, pairs) = ((1, 2, (64, 8)) if args.tiny else
                                  _recorded_steps())
  common.log(f'mt_timeline: step {step} ({pairs} pairs of ≤ {length} pieces)')
  logdir = tempfile.mkdtemp(prefix='mt_timeline_')
  try:
    subprocess.run(
        [sys.executable, '-m', 'lingvo_pipe.launch', '--num_stages=2', '--',
         f'--model={MODEL}', f'--logdir={logdir}', f'--max_steps={step}',
         f'--timeline_steps={warm},{step}', '--model_params_override=' +
         (_TINY if args.tiny else '') +
         'task.train.save_interval_steps: 100000'], check=True, timeout=3600)
    os.makedirs(args.out_dir, exist_ok=True)
    made = os.path.join(logdir, 'timeline', f'step_{step}')
    shutil.copy(made + '.png', os.path.join(args.out_dir, PNG))
    shutil.copy(made + '.trace.json', os.path.join(args.out_dir, TRACE))
  finally:
    shutil.rmtree(logdir, ignore_errors=True)
  with open(os.path.join(args.out_dir, TRACE)) as f:
    events = json.load(f)['traceEvents']
  names = {e['pid']: e['args']['name'] for e in events
           if e['name'] == 'process_name'}
  measured = [timeline.Record(e['tid'], e['args']['micro_batch'],
                              e['name'][0], e['ts'] / 1e6,
                              (e['ts'] + e['dur']) / 1e6)
              for e in events if e['ph'] == 'X' and
              names[e['pid']] == 'measured']
  return {'step': step, 'bucket': [length, pairs], 'png': PNG,
          'trace': TRACE, 'span_s': max(r.end for r in measured),
          'overlap': timeline.overlap_fraction(measured),
          'ops': len(measured),
          'M': len({r.micro_batch for r in measured}),
          'recompute': any(r.kind == 'R' for r in measured)}


def render(s: dict[str, Any]) -> str:
  length, pairs = s['bucket']
  return '\n'.join([
      f'{MODEL} on 2 stage processes (`lingvo_pipe.launch --num_stages=2`), '
      f'training step {s["step"]} (a bucket of {pairs} pairs of ≤ {length} '
      f'pieces, M={s.get("M", 4)}, '
      f'{"recompute" if s.get("recompute", True) else "no recompute"}), '
      'recorded by the trainer\'s `--timeline_steps`: each '
      'task its own stage, merged by the chief; above, measured; below, the '
      'simulator on this step\'s median op times.',
      '',
      f'![A TransformerSmall step on 2 stage processes]({s["png"]})',
      '',
      f'- {s["ops"]} ops, span {s["span_s"]:.3f} s; both processes busy '
      f'at once {100 * s["overlap"]:.0f}% of the busy time.',
      f'- Chrome trace: [{s["trace"]}]({s["trace"]}).',
  ])
