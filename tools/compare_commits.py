"""Benchmarks two commits side by side: the no-regression check.

    python tools/compare_commits.py 905ecef               # against HEAD
    python tools/compare_commits.py 905ecef HEAD --rounds=3 \\
        --sections=efficiency,peer --out_dir=/tmp/compare

Each commit is checked out into a temporary git worktree and runs its own
`tools/benchmark.py SECTION --rounds 1` with this Python, the two commits
in ABBA order round by round (old then new, new then old, ...), so a drift
in the machine's speed falls on both. Prints each figure per round and
new ÷ old of the medians, and writes the results to --out_dir/compare.json
(each call's own benchmarks.json and log stay beside it). Speed figures
only mean something on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Callable

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _efficiency(s: dict[str, Any]) -> dict[str, float]:
  r = s['rounds'][0]
  return {'efficiency': r['efficiency'], 'K=2 step (s)': r['step_s']['k2'],
          'K=1 step (s)': r['step_s']['k1']}


def _peer(s: dict[str, Any]) -> dict[str, float]:
  out = {f'{k} step (s)': v for k, v in s['ours'].items()}
  if s.get('torch'):
    out.update({f'{k} ÷ torch': v / s['torch'][k]
                for k, v in s['ours'].items() if k in s['torch']})
  return out


# Section → its figures from one call's benchmarks.json entry.
FIGURES: dict[str, Callable[[dict[str, Any]], dict[str, float]]] = {
    'efficiency': _efficiency, 'peer': _peer}


def order(rounds: int) -> list[tuple[int, str]]:
  """(round, 'old' | 'new') in ABBA order."""
  out = []
  for r in range(rounds):
    pair = ('old', 'new') if r % 2 == 0 else ('new', 'old')
    out += [(r, which) for which in pair]
  return out


def summary(figures: dict[str, dict[str, list[float]]]) -> list[list[Any]]:
  """Rows [figure, old per round, new per round, new ÷ old of medians]
  from {'old'|'new': {figure: [value per round]}}."""
  rows = []
  for name, old in figures['old'].items():
    new = figures['new'].get(name, [])
    if not old or not new:
      continue
    ratio = statistics.median(new) / statistics.median(old)
    rows.append([name, ', '.join(f'{v:.4g}' for v in old),
                 ', '.join(f'{v:.4g}' for v in new), f'{ratio:.3f}'])
  return rows


def _git(*args: str) -> str:
  return subprocess.run(['git', '-C', _ROOT, *args], check=True,
                        capture_output=True, text=True).stdout.strip()


def _run(tree: str, section: str, out_dir: str) -> dict[str, Any]:
  os.makedirs(out_dir, exist_ok=True)
  env = dict(os.environ, PYTHONPATH=tree)
  with open(os.path.join(out_dir, 'log.txt'), 'w') as log:
    subprocess.run([sys.executable, 'tools/benchmark.py', section,
                    '--rounds', '1', '--out_dir', out_dir], cwd=tree,
                   env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
  with open(os.path.join(out_dir, 'benchmarks.json')) as f:
    return json.load(f)[section]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('old', help='The earlier commit (any git revision).')
  parser.add_argument('new', nargs='?', default='HEAD')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--sections', default='efficiency,peer',
                      help=f'Comma-separated; known: {", ".join(FIGURES)}.')
  parser.add_argument('--out_dir', default='')
  args = parser.parse_args(argv)
  sections = [s for s in args.sections.split(',') if s]
  unknown = [s for s in sections if s not in FIGURES]
  if unknown or args.rounds < 1:
    print(f'compare_commits: --sections={args.sections} --rounds='
          f'{args.rounds}: give sections among {", ".join(FIGURES)} and '
          'rounds ≥ 1.', file=sys.stderr)
    return 2
  revs = {}
  for which, rev in (('old', args.old), ('new', args.new)):
    try:
      revs[which] = _git('rev-parse', '--verify', f'{rev}^{{commit}}')
    except subprocess.CalledProcessError:
      print(f'compare_commits: {rev!r} is not a commit of {_ROOT}; give a '
            'revision git knows (a hash, a tag, HEAD~3).', file=sys.stderr)
      return 2
  out_dir = args.out_dir or tempfile.mkdtemp(prefix='lp_compare_')
  work = tempfile.mkdtemp(prefix='lp_trees_')
  trees = {w: os.path.join(work, w) for w in revs}
  figures: dict[str, dict[str, dict[str, list[float]]]] = {
      s: {'old': {}, 'new': {}} for s in sections}
  try:
    for which, tree in trees.items():
      _git('worktree', 'add', '--detach', tree, revs[which])
    for r, which in order(args.rounds):
      for section in sections:
        print(f'[compare] round {r + 1}: {which} ({revs[which][:7]}) '
              f'{section}', flush=True)
        where = os.path.join(out_dir, f'{which}_{section}_{r + 1}')
        try:
          got = _run(trees[which], section, where)
        except subprocess.CalledProcessError:
          print(f'compare_commits: {section} failed on {which} '
                f'({revs[which][:7]}); its log: {where}/log.txt',
                file=sys.stderr)
          return 1
        for name, value in FIGURES[section](got).items():
          figures[section][which].setdefault(name, []).append(value)
  finally:
    for tree in trees.values():
      if os.path.isdir(tree):
        _git('worktree', 'remove', '--force', tree)
  with open(os.path.join(out_dir, 'compare.json'), 'w') as f:
    json.dump({'revs': revs, 'rounds': args.rounds, 'figures': figures}, f,
              indent=1)
  print(f'old {revs["old"][:7]}, new {revs["new"][:7]}, {args.rounds} '
        'round(s), ABBA')
  for section in sections:
    print(f'\n{section}\n| figure | old | new | new ÷ old (medians) |\n'
          '|---|---|---|---|')
    for row in summary(figures[section]):
      print('| ' + ' | '.join(row) + ' |')
  print(f'\n{out_dir}/compare.json')
  return 0


if __name__ == '__main__':
  sys.exit(main())
