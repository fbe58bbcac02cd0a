"""The sub-commands, in report order, and where their results go."""

from __future__ import annotations

import argparse
from typing import Any

from bench import common
from bench import efficiency
from bench import fidelity
from bench import keras_bench
from bench import links_bench
from bench import mt_timeline
from bench import overheads
from bench import overlap
from bench import partition_bench
from bench import peer
from bench import plots
from bench import report
from bench import schedules
from bench import slices
from bench import split_bench
from bench import table1
from bench import timeline_bench
from bench import training
from bench import tracing
from bench import zero_bubble

# name: (title, module with run(args) and render(section)).
_SECTIONS = {
    'efficiency': ('Efficiency of K=2 stage processes, and data parallelism '
                   '(GPipe Table 2)', efficiency),
    'overlap': ('Overlap of K=3 and K=4 stage processes', overlap),
    'table1': ('Largest trainable model per memory budget, measured (GPipe '
               'Table 1)', table1),
    'peer': ('Beside torch.distributed.pipelining', peer),
    'slices': ('Stage processes: the compute threads\' scheduler slice',
               slices),
    'schedules': ('Schedules: activation memory and step time (1F1B vs '
                  'GPipe)', schedules),
    'fidelity': ('Simulator fidelity', fidelity),
    'partition': ('Profile-driven partitioning', partition_bench),
    'overheads': ('Overheads and tracing time in one process', overheads),
    'tracing': ('Tracing and graph size of stage processes as M grows',
                tracing),
    'timeline': ('Timelines of one step per schedule', timeline_bench),
    'keras': ('A wrapped Keras CNN vs the same network in lingvo_pipe '
              'layers', keras_bench),
    'links': ('K=2 over rate-limited links between hosts, and the '
              'simulator at scale', links_bench),
    'split': ('The backward split into I and W: I + W ÷ B', split_bench),
    'zero_bubble': ('Zero-bubble schedules (ZB-H1, ZB-V) beside 1F1B and '
                    'torch', zero_bubble),
    'mt_timeline': ('A translation step on 2 stage processes '
                    '(--timeline_steps, merged)', mt_timeline),
    'training': ('60-minute training runs: translation on 2 stage processes '
                 'vs one, the language model tied vs untied', training),
}
NAMES = tuple(_SECTIONS)
TITLES = tuple(title for title, _ in _SECTIONS.values())
NOT_IN_ALL = ('training',)  # Four hours: run it on its own.
# Where a section ran, unless it says so itself: most start stage processes.
_DEVICES = {'partition': 'this process (single-threaded TF; each stage\'s '
                         'layers timed alone, by CPU time)',
            'training': 'the binaries, as a user runs them (one run at a '
                        'time)'}
_STAGE_PROCESSES = ('stage processes started by `lingvo_pipe.launch` (one '
                    'per stage and replica, task i pinned to core i mod 2)')


def run_section(args: argparse.Namespace) -> dict[str, Any]:
  """Runs one sub-command; returns its JSON section."""
  return _SECTIONS[args.command][1].run(args)


def store(out_dir: str, name: str, section: dict[str, Any], command: str,
          seconds: float, args: argparse.Namespace,
          load: tuple[float, float]) -> None:
  """Merges `section` into the JSON and re-renders the report.

  `load`: the 1-minute load average before and after the section ran.
  """
  results = report.load(out_dir)
  section.setdefault('devices', _DEVICES.get(name, _STAGE_PROCESSES))
  section.update(command=command, seconds=seconds, machine=report.machine(),
                 tiny=bool(args.tiny), load=list(load))
  results[name] = section
  results['run'] = {'command': command, 'seconds': seconds,
                    'machine': section['machine']}
  _write(out_dir, results)


def finish(out_dir: str, command: str, seconds: float) -> None:
  """After `all`: the header names the whole run."""
  results = report.load(out_dir)
  results['run'] = {'command': command, 'seconds': seconds,
                    'machine': report.machine()}
  _write(out_dir, results)


def _write(out_dir: str, results: dict[str, Any]) -> None:
  for stale in [k for k in results if k not in _SECTIONS and k != 'run']:
    del results[stale]  # Sections this version no longer has.
  report.save(out_dir, results)
  plots.write_all(out_dir, results)
  text = report.render(results, [(name, title, module.render)
                                 for name, (title, module)
                                 in _SECTIONS.items()])
  path = report.write_markdown(out_dir, text)
  common.log(f'wrote {path}')
