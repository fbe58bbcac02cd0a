"""The sub-commands: which devices each needs, and where its results go."""

from __future__ import annotations

import argparse
from typing import Any

from bench import common
from bench import fidelity
from bench import memory
from bench import overheads
from bench import plots
from bench import report
from bench import throughput
from bench import timeline_bench

# name: (title, number of stage devices, module with run and render).
_SECTIONS = {
    'throughput': ('Throughput (GPipe Table 2)', 2, throughput),
    'memory': ('Memory (GPipe Table 1)', 0, memory),
    'overheads': ('Overheads', 1, overheads),
    'fidelity': ('Simulator fidelity', 2, fidelity),
    'timeline': ('Timeline of a K=2, M=4 step', 2, timeline_bench),
}
NAMES = tuple(_SECTIONS)


def run_section(args: argparse.Namespace) -> dict[str, Any]:
  """Runs one sub-command on its devices; returns its JSON section."""
  _, num_devices, module = _SECTIONS[args.command]
  if not num_devices:  # Memory: logical devices of this process, always.
    return module.run(args, [])
  with common.stage_devices(num_devices, args.devices) as devices:
    return module.run(args, devices)


def store(out_dir: str, name: str, section: dict[str, Any], command: str,
          seconds: float, args: argparse.Namespace) -> None:
  """Merges `section` into the JSON and re-renders the report."""
  results = report.load(out_dir)
  section.update(command=command, seconds=seconds, machine=report.machine(),
                 tiny=bool(args.tiny),
                 devices=('logical CPU devices of one process'
                          if args.devices == 'logical' or name == 'memory'
                          else 'stage 0 on the benchmark process pinned to core 0, each '
                          'further stage on a single-core TF worker process'))
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
  report.save(out_dir, results)
  plots.write_all(out_dir, results)
  text = report.render(results, [(name, title, module.render)
                                 for name, (title, _, module)
                                 in _SECTIONS.items()])
  path = report.write_markdown(out_dir, text)
  common.log(f'wrote {path}')
