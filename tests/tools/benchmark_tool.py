"""tools/benchmark.py loaded for the tests, and what each section must show.

Shared by test_benchmark.py (every section rendered from recorded tiny
results: cheap, in CI) and test_benchmark_sections.py (every section run
end to end at tiny sizes: tagged rehearsal).
"""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, 'tools', 'benchmark.py')
# Tiny results of every section, recorded by `python tools/benchmark.py
# NAME --tiny --out_dir tests/tools/data/tiny` (only benchmarks.json is kept).
RECORDED = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data',
                        'tiny', 'benchmarks.json')


def alive(pid: int) -> bool:
  """Whether process `pid` still exists (not yet reaped)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def load():
  """The benchmark tool as a module; puts tools/ on sys.path for `bench`."""
  spec = importlib.util.spec_from_file_location('benchmark_tool', TOOL)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# What each section's Markdown must show: table headers, targets, papers.
EXPECTED = {
    'efficiency': ['| round | K=1 step (s) | K=2 step (s)', 'C_stage',
                   'pipeline efficiency K=2, M=8, round 1',
                   'data parallel R=2 × K=1', 'GPipe AmoebaNet (TPU)',
                   '| 32 | 8 | 6.56 | 3.48 | 6.3 | 4.95 |'],
    'overlap': ['| K | schedule | stages | both busy, measured (ms)',
                'K=4 gpipe: stages 2-3 busy at once',
                'K=3 1f1b: stages 1-2 busy at once'],
    'table1': ['| config | max layers |', '| naive |', '| pipeline-4 |',
               '(18, 208)', '1663 layers', 'TF_CPU_BFC_MEM_LIMIT_IN_MB',
               'table1.png'],
    'peer': ['| config | lingvo_pipe', 'K=2, M=8'],
    'slices': ['| configuration | launch 1: off / on (s)', 'K=2 1f1b M=8',
               'Step time saved by the short slice'],
    'schedules': ['**Memory**', 'peak activation memory 1F1B ÷ GPipe, K=2, '
                  'M=32', '1F1B growth M=8 → M=32',
                  'step time 1F1B ÷ GPipe, K=2, M=8', 'interleaved',
                  'schedules_memory.png'],
    'fidelity': ['| K | M | schedule | measured step (s) | predicted (s) |',
                 'round 1: worst |predicted ÷ measured − 1|', 'fidelity.png'],
    'tracing': ['| round | schedule | ops M=2 | ops M=8',
                'gpipe: graph ops at M=8 ÷ M=2 − 1',
                '1f1b: tracing + first step at M=8 ÷ M=2',
                'the tracing alone'],
    'partition': ['| K | partition by | boundaries',
                  'profile partition, K=2'],
    'overheads': ['| step | time (s) |', 'hand-written',
                  '| form | M | graph ops | trace (s) |',
                  'tracing time M=64 ÷ M=8, FPropLoss 1f1b'],
    'timeline': ['timeline_k2_m8.png', 'timeline_k2_m8.trace.json',
                 'most micro-batches held per stage'],
    'split': ['| network | F | B (R+B) | I (R+I) | W | I + W ÷ B',
              'I + W ÷ B, mlp_16x512', '| network | B | F+B kept | I |'],
    'zero_bubble': ['| schedule | recompute | M | step (s) | ÷ 1F1B',
                    'zb_v step ÷ 1F1B, K=2, M=8, recompute never',
                    'zb_h1 peak activation memory ÷ 1F1B, M=8'],
    'mt_timeline': ['timeline_mt_k2.png', 'timeline_mt_k2.trace.json',
                    'both processes busy at once'],
    'keras': ['| network | first call (s) | step (s) |', '| wrapped Keras |',
              'wrapped Keras ÷ lingvo_pipe layers, step time'],
    'training': ['| model | runtime | steps | trained (min) | test BLEU',
                 'At step 2, the last checkpoint both kept: mt_k2 BLEU',
                 'lm_tied perplexity',
                 'test BLEU, 2 stage processes − one process',
                 'test perplexity, tied − untied', 'Commands, in this order'],
    # The paper part; the measured part needs network namespaces (root).
    'links': ['| 32 | 8 | 6.56 | 6.3 | 3.48 | 4.95 |',
              'Between hosts 10 Gbit/s'],
}
LINKS_MEASURED = ['| schedule | M | link | boundary |', '100 Mbit/s',
                  'round 1: worst |predicted ÷ measured − 1|']
LINKS_NOT_MEASURED = ['Not measured: ']
FILES = {'table1': ['table1.png'], 'schedules': ['schedules_memory.png'],
          'fidelity': ['fidelity.png'],
          'timeline': ['timeline_k2_m8.png', 'timeline_k2_m8.trace.json']}
# Sections that draw their pictures while they run, not from their JSON.
DRAWN_WHILE_RUNNING = ('timeline', 'mt_timeline')
