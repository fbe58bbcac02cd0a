"""Long training runs: the translation model and the language model, 60 min.

The quality figures of README's model table, run with the binaries as a user
runs them, one after the other (each has the whole machine):

- mt.bible_en_es.TransformerSmall on 2 stage processes and in one process
  (`--max_steps=100000`: the config's own 1,000 steps end in ~40 minutes);
  the target is test BLEU on 2 stage processes ≥ one process's − 0.5;
- lm.bible_en.TransformerLmSmall and its Untied twin on 2 stage processes;
  the target is a tied test perplexity ≤ the untied one's.

Each pair is also scored at the last checkpoint step both runs kept
(`evaler --checkpoint`): quality per step, apart from steps per hour.

Each run is `--max_train_minutes=60`, then `evaler --eval_dataset=Test
--mode=latest`. Four hours in all, so `benchmark.py all` leaves this section
out. A run whose logdir (under --runs_dir) holds this section's record of a
finished training (`<name>.run.json` beside it: command, commit, times, and
an optional "note" on what else ran) is scored, not trained again: delete
the logdir to train it anew. With --tiny: 2 steps each (translation steps
of 8 pairs), scored on a few lines of text, in a temporary directory (the
machinery, in minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import tensorflow as tf
from tensorflow.core.util import event_pb2

from bench import common
from bench import report
from lingvo_pipe.core import checkpoints

MINUTES = 60


@dataclasses.dataclass(frozen=True)
class Run:
  name: str
  model: str
  num_stages: int  # 2: `lingvo_pipe.launch --num_stages=2`; 1: the trainer.
  metric: str  # The test metric of the target.
  flags: tuple[str, ...] = ()


_MT = 'mt.bible_en_es.TransformerSmall'
RUNS = (
    Run('mt_k2', _MT, 2, 'bleu', ('--max_steps=100000',)),
    Run('mt_one', _MT, 1, 'bleu', ('--max_steps=100000',)),
    Run('lm_tied', 'lm.bible_en.TransformerLmSmall', 2, 'perplexity'),
    Run('lm_untied', 'lm.bible_en.TransformerLmSmallUntied', 2, 'perplexity'),
)
# (run, its reference, how the run may trail it, what a miss means).
_TARGETS = (('mt_k2', 'mt_one', 'test BLEU, 2 stage processes − one process',
             '>=', -0.5),
            ('lm_tied', 'lm_untied', 'test perplexity, tied − untied', '<=',
             0.0))
# Pairs also scored at the last checkpoint step both kept: quality per step,
# apart from steps per hour.
_SAME_STEP = (('mt_k2', 'mt_one'), ('lm_tied', 'lm_untied'))

# --tiny: short MT buckets, and a few lines of text to score on.
_TINY_MT = 'input.bucket_upper_bounds: [64]; input.bucket_batch_sizes: [8]'
_TINY_LINES = ('In the beginning God created the heaven and the earth.\t'
               'En el principio creó Dios los cielos y la tierra.',
               'And the earth was without form, and void.\t'
               'Y la tierra estaba desordenada y vacía.') * 8


def _train_command(run: Run, logdir: str, tiny: bool) -> list[str]:
  flags = [f'--model={run.model}', f'--logdir={logdir}']
  if tiny:
    flags += ['--max_steps=2'] + (
        [f'--model_params_override={_TINY_MT}'] if run.model == _MT else [])
  else:
    flags += [*run.flags, f'--max_train_minutes={MINUTES}']
  if run.num_stages == 1:
    return ['-m', 'lingvo_pipe.trainer', *flags]
  return ['-m', 'lingvo_pipe.launch', f'--num_stages={run.num_stages}', '--',
          *flags]


def _eval_command(run: Run, logdir: str, text: str,
                  checkpoint: int = 0) -> list[str]:
  cmd = ['-m', 'lingvo_pipe.evaler', f'--logdir={logdir}',
         '--eval_dataset=Test']
  cmd += [f'--checkpoint={checkpoint}'] if checkpoint else ['--mode=latest']
  if text:
    key = 'tsv_path' if run.model == _MT else 'text_path'
    cmd.append(f'--model_params_override=input.{key}: {text}')
  return cmd


def _shown(cmd: list[str]) -> str:
  return 'python ' + ' '.join(cmd)


def _python(cmd: list[str]) -> None:
  common.log(_shown(cmd))
  subprocess.run([sys.executable, *cmd], check=True, timeout=4 * 3600)


def _train(run: Run, logdir: str, tiny: bool) -> dict[str, Any]:
  """Trains `run` unless its record says it finished; returns the record."""
  record_path = logdir + '.run.json'
  if os.path.exists(record_path) and checkpoints.list_checkpoints(logdir):
    with open(record_path, encoding='utf-8') as f:
      record = json.load(f)
    common.log(f'{run.name}: reusing {logdir} (trained {record["started"]})')
    return record
  cmd = _train_command(run, logdir, tiny)
  started = time.strftime('%Y-%m-%d %H:%M')
  _python(cmd)
  record = {'command': _shown(cmd), 'started': started,
            'commit': _commit(), 'ended': time.strftime('%Y-%m-%d %H:%M'),
            'cpu': report.machine()['cpu']}
  checkpoints.write_file_atomically(record_path, json.dumps(record, indent=1))
  return record


def _commit() -> str:
  out = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'],
                       capture_output=True, text=True, check=False,
                       cwd=os.path.dirname(os.path.abspath(__file__)))
  return out.stdout.strip() or 'unknown'


def _score(run: Run, logdir: str, text: str, checkpoint: int = 0
           ) -> dict[str, Any]:
  """The Test score of `checkpoint` (0: the newest), scored if need be."""
  step = checkpoint or checkpoints.step_of(
      checkpoints.list_checkpoints(logdir)[-1])
  path = os.path.join(logdir, 'eval_test', f'ckpt-{step}.json')
  if not os.path.exists(path):
    _python(_eval_command(run, logdir, text, checkpoint))
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def _train_minutes(logdir: str) -> float:
  """Minutes from the first to the last training summary event."""
  times = [event_pb2.Event.FromString(record.numpy()).wall_time
           for path in tf.io.gfile.glob(
               os.path.join(logdir, 'train', 'events.out.tfevents.*'))
           for record in tf.data.TFRecordDataset(path)]
  return (max(times) - min(times)) / 60 if times else 0.0


def selected(runs: str) -> tuple[Run, ...]:
  """RUNS named in `runs` (comma-separated; empty: all), in RUNS' order.

  Raises ValueError naming an unknown run, a pair given half, or none.
  """
  names = [n for n in runs.split(',') if n] if runs else [
      r.name for r in RUNS]
  known = [r.name for r in RUNS]
  if not names:
    raise ValueError(f'--runs={runs!r} names no run; the runs are '
                     f'{",".join(known)}.')
  for n in names:
    if n not in known:
      raise ValueError(f'--runs: no run {n!r}; the runs are '
                       f'{",".join(known)}.')
  for pair in _SAME_STEP:
    if (pair[0] in names) != (pair[1] in names):
      raise ValueError(f'--runs: {pair[0]} and {pair[1]} are compared with '
                       f'each other, so they train on the same machine: '
                       f'name both, e.g. --runs={",".join(pair)}.')
  return tuple(r for r in RUNS if r.name in names)


def run(args: argparse.Namespace) -> dict[str, Any]:
  runs = selected(getattr(args, 'runs', ''))
  if not args.tiny:
    os.makedirs(args.runs_dir, exist_ok=True)
    kept = {}
    if len(runs) < len(RUNS):
      kept = report.load(args.out_dir).get('training', {})
    return _run(args.runs_dir, '', tiny=False, runs=runs, kept=kept)
  runs_dir = tempfile.mkdtemp(prefix='lp_training_tiny_')
  try:
    text = os.path.join(runs_dir, 'tiny_test.tsv')
    with open(text, 'w', encoding='utf-8') as f:
      f.write('\n'.join(_TINY_LINES) + '\n')
    return _run(runs_dir, text, tiny=True, runs=runs, kept={})
  finally:
    shutil.rmtree(runs_dir, ignore_errors=True)


def _run(runs_dir: str, text: str, tiny: bool, runs: tuple[Run, ...],
         kept: dict[str, Any]) -> dict[str, Any]:
  """Trains and scores `runs` under `runs_dir`; `text`: the test lines.

  `kept`: the stored section, whose rows of the other runs stay (with the
  CPU they trained on: the section's, for rows stored before rows had one).
  """
  rows = {}
  for name, row in kept.get('rows', {}).items():
    if name not in [r.name for r in runs]:
      rows[name] = dict(row)
      rows[name].setdefault('cpu', kept.get('machine', {}).get('cpu', '?'))
  for r in runs:
    logdir = os.path.join(runs_dir, r.name)
    record = _train(r, logdir, tiny)
    score = _score(r, logdir, text)
    rows[r.name] = {
        'model': r.model, 'num_stages': r.num_stages, 'metric': r.metric,
        'trained': record, 'steps': score['step'],
        'train_minutes': _train_minutes(logdir),
        'metrics': score['metrics'],
        'cpu': record.get('cpu', report.machine()['cpu']),
        'evaluate': _shown(_eval_command(r, logdir, ''))}
  names = [r.name for r in runs]
  same_step = [_at_same_step(runs_dir, text, pair) for pair in _SAME_STEP
               if pair[0] in names]
  same_step = [s for s in same_step if s] + [
      s for s in kept.get('same_step', [])
      if not set(s['metrics']) & set(names)]
  order = {frozenset(pair): i for i, pair in enumerate(_SAME_STEP)}
  same_step.sort(key=lambda s: order.get(frozenset(s['metrics']), len(order)))
  targets = []
  for name, ref, what, op, limit in _TARGETS:
    if name not in rows or ref not in rows:
      continue
    metric = rows[name]['metric']
    targets.append(report.target(
        what, rows[name]['metrics'][metric] - rows[ref]['metrics'][metric],
        op, limit, unit=''))
  return {'rows': rows, 'same_step': same_step,
          'targets': targets,
          'minutes': MINUTES, 'runs_dir': runs_dir}


def _at_same_step(runs_dir: str, text: str, pair: tuple[str, str]
                  ) -> dict[str, Any] | None:
  """Both runs of `pair` scored at the last checkpoint step both kept."""
  runs = [next(r for r in RUNS if r.name == n) for n in pair]
  steps = [{checkpoints.step_of(c) for c in checkpoints.list_checkpoints(
      os.path.join(runs_dir, r.name))} for r in runs]
  shared = steps[0] & steps[1]
  if not shared:
    return None
  step = max(shared)
  return {'step': step, 'metrics': {
      r.name: _score(r, os.path.join(runs_dir, r.name), text, step)['metrics']
      for r in runs}}


def _in_order(rows: dict[str, Any]) -> list[dict[str, Any]]:
  """`rows` in RUNS' order (a reloaded benchmarks.json sorts its keys)."""
  return [rows[r.name] for r in RUNS if r.name in rows]


def render(s: dict[str, Any]) -> str:
  rows = []
  for row in _in_order(s['rows']):
    m = row['metrics']
    where = ('one process' if row['num_stages'] == 1 else
             f'{row["num_stages"]} stage processes')
    rows.append([f'`{row["model"]}`', where, row['steps'],
                 f'{row["train_minutes"]:.1f}',
                 f'{m["bleu"]:.2f}' if 'bleu' in m else None,
                 f'{m["log_pplx"]:.4f}', f'{m["perplexity"]:.2f}',
                 row.get('cpu', s['machine']['cpu']),
                 row['trained']['started'], row['trained']['commit']])
  lines = [
      f'Each run trains for {s["minutes"]} minutes (`--max_train_minutes`), '
      'one run at a time, then the evaler scores its newest checkpoint on '
      'the held-out test books.', '',
      report.table(['model', 'runtime', 'steps', 'trained (min)',
                    'test BLEU', 'test log-pplx', 'test perplexity',
                    'CPU', 'started', 'commit'], rows), '']
  for same in s['same_step']:
    lines.append(
        f'- At step {same["step"]}, the last checkpoint both kept: ' +
        '; '.join(f'{name} ' + (f'BLEU {m["bleu"]:.2f}, ' if 'bleu' in m
                                else f'perplexity {m["perplexity"]:.2f}, ')
                  + f'log-pplx {m["log_pplx"]:.4f}'
                  for name, m in same['metrics'].items()) + '.')
  lines.append(report.target_lines(s['targets']))
  lines += ['', 'Commands, in this order:', '']
  lines += [f'- `{row["trained"]["command"]}`'
            + (' (run by hand, the same command)' if row['trained'].get(
                'by_hand') else '') + f', then `{row["evaluate"]}`'
            + (f'; {row["trained"]["note"]}' if row['trained'].get('note')
               else '')
            for row in _in_order(s['rows'])]
  return '\n'.join(lines)
