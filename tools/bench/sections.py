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

# name: (title, number of stage devices, module with Run and Render).
_SECTIONS = {
    'throughput': ('Throughput (GPipe Table 2)', 2, throughput),
    'memory': ('Memory (GPipe Table 1)', 0, memory),
    'overheads': ('Overheads', 1, overheads),
    'fidelity': ('Simulator fidelity', 2, fidelity),
    'timeline': ('Timeline of a K=2, M=4 step', 2, timeline_bench),
}
NAMES = tuple(_SECTIONS)


def RunSection(args: argparse.Namespace) -> dict[str, Any]:
  """Runs one sub-command on its devices; returns its JSON section."""
  _, num_devices, module = _SECTIONS[args.command]
  if not num_devices:  # Memory: logical devices of this process, always.
    return module.Run(args, [])
  with common.StageDevices(num_devices, args.devices) as devices:
    return module.Run(args, devices)


def Store(out_dir: str, name: str, section: dict[str, Any], command: str,
          seconds: float, args: argparse.Namespace) -> None:
  """Merges `section` into the JSON and re-renders the report."""
  results = report.Load(out_dir)
  section.update(command=command, seconds=seconds, machine=report.Machine(),
                 tiny=bool(args.tiny),
                 devices=('logical CPU devices of one process'
                          if args.devices == 'logical' or name == 'memory'
                          else 'single-core TF worker processes'))
  results[name] = section
  results['run'] = {'command': command, 'seconds': seconds,
                    'machine': section['machine']}
  _Write(out_dir, results)


def Finish(out_dir: str, command: str, seconds: float) -> None:
  """After `all`: the header names the whole run."""
  results = report.Load(out_dir)
  results['run'] = {'command': command, 'seconds': seconds,
                    'machine': report.Machine()}
  _Write(out_dir, results)


def _Write(out_dir: str, results: dict[str, Any]) -> None:
  report.Save(out_dir, results)
  plots.WriteAll(out_dir, results)
  text = report.Render(results, [(name, title, module.Render)
                                 for name, (title, _, module)
                                 in _SECTIONS.items()])
  path = report.WriteMarkdown(out_dir, text)
  common.Log(f'wrote {path}')
