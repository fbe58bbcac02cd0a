"""One process of the peer: torch.distributed.pipelining on gloo (peer.py).

    python tools/bench/torch_peer.py --rank=0 --world=2 --port=P \\
        --layers=16 --width=512 --batch=1024 --micro_batches=8 --out=r0.json

The same network as ours (L × Linear(W, W) + ReLU, square loss ÷ batch,
SGD), cut in two by `pipeline()` at the middle layer, each stage in its own
process on one core with one thread. Configurations, timed in alternation
with a gloo barrier before each step (rank 1 waits at the barrier while
rank 0 runs the one-process step alone):

  k1      rank 0 alone: the whole model, M micro-batches, forward + backward
          per micro-batch (gradient accumulation), SGD;
  gpipe   ScheduleGPipe over both processes;
  1f1b    Schedule1F1B over both processes;
  zb_interleaved  ScheduleInterleavedZeroBubble (ZB1P: ZB-H1), one stage
          per process;
  zb_v    ScheduleZBVZeroBubble: the model cut in four, two stages per
          process in a V (rank 0: stages 0 and 3).

`--configs` picks which (default k1,gpipe,1f1b).

Writes {config: [seconds per step]} as JSON. Written for lingvo_pipe's
benchmark with torch's public pipelining API only.
"""

import argparse
import json
import os
import time
from typing import Any

import torch
from torch import nn
import torch.distributed as dist
from torch.distributed import pipelining

LEARNING_RATE = 1e-6


def _model(layers: int, width: int) -> nn.Sequential:
  torch.manual_seed(0)
  mods = []
  for _ in range(layers):
    mods += [nn.Linear(width, width), nn.ReLU()]
  return nn.Sequential(*mods)


def _cut(layers: int, parts: int) -> dict[str, Any]:
  """Split points of the Sequential (two modules per layer) into parts."""
  return {str(2 * (layers * i // parts)): pipelining.SplitPoint.BEGINNING
          for i in range(1, parts)}


def _pipelined(name: str, a: Any, x: torch.Tensor, target: torch.Tensor,
               loss_fn: Any) -> Any:
  """One pipelined training step of schedule `name` on this rank."""
  n, m = a.batch, a.micro_batches
  v = name == 'zb_v'
  pipe = pipelining.pipeline(
      _model(a.layers, a.width), mb_args=(x[:n // m],),
      split_spec=_cut(a.layers, 4 if v else 2))
  cpu = torch.device('cpu')
  if v:  # The V: rank r holds stages r and 3 - r. (PipelineStage: the
    # stages `build_stage` makes post a send to themselves between the
    # two stages of rank 1, which gloo refuses.)
    stages = [pipelining.PipelineStage(pipe.get_stage_module(s), s, 4, cpu)
              for s in (a.rank, 3 - a.rank)]
    schedule = pipelining.ScheduleZBVZeroBubble(stages, n_microbatches=m,
                                                loss_fn=loss_fn)
  elif name == 'zb_interleaved':
    stages = [pipe.build_stage(a.rank, cpu)]
    schedule = pipelining.ScheduleInterleavedZeroBubble(
        stages, n_microbatches=m, loss_fn=loss_fn)
  else:
    stages = [pipe.build_stage(a.rank, cpu)]
    cls = {'gpipe': pipelining.ScheduleGPipe,
           '1f1b': pipelining.Schedule1F1B}[name]
    schedule = cls(stages[0], n_microbatches=m, loss_fn=loss_fn)
  params = [p for st in stages for p in st.submod.parameters()]
  opt = torch.optim.SGD(params, lr=LEARNING_RATE)
  # Who feeds the input and who computes the loss: stage 0 and the last.
  first = any(st.is_first for st in stages)
  last = any(st.is_last for st in stages)

  def step() -> None:
    opt.zero_grad()
    kwargs = {}
    if last:
      kwargs = {'target': target, 'losses': []}
    schedule.step(*((x,) if first else ()), **kwargs)
    opt.step()
  return step


def main() -> None:
  parser = argparse.ArgumentParser()
  for name in ('rank', 'world', 'port', 'layers', 'width', 'batch',
               'micro_batches', 'reps', 'warmup'):
    parser.add_argument(f'--{name}', type=int, required=name not in (
        'reps', 'warmup'), default=5 if name == 'reps' else 1)
  parser.add_argument('--out', required=True)
  parser.add_argument('--configs', default='k1,gpipe,1f1b')
  a = parser.parse_args()
  torch.set_num_threads(1)
  torch.set_num_interop_threads(1)
  dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{a.port}',
                          rank=a.rank, world_size=a.world)
  n, m = a.batch, a.micro_batches
  x = torch.randn(n, a.width, generator=torch.Generator().manual_seed(7))
  target = torch.zeros(n, 1)

  def loss_fn(out: torch.Tensor, unused_target: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum() / n  # Summed over micro-batches: the mean.

  configs = a.configs.split(',')
  steps = {}
  if 'k1' not in configs:
    pass
  elif a.rank == 0:  # One process, the whole model: the K=1 reference.
    whole = _model(a.layers, a.width)
    opt1 = torch.optim.SGD(whole.parameters(), lr=LEARNING_RATE)

    def k1() -> None:
      opt1.zero_grad()
      for part in x.chunk(m):
        loss_fn(whole(part), target).backward()
      opt1.step()
    steps['k1'] = k1
  else:
    steps['k1'] = None
  for name in configs:
    if name != 'k1':
      steps[name] = _pipelined(name, a, x, target, loss_fn)
  times = {name: [] for name in steps}
  for rep in range(a.warmup + a.reps):
    for name, fn in steps.items():
      dist.barrier()
      if fn is None:
        continue
      start = time.perf_counter()
      fn()
      if rep >= a.warmup:
        times[name].append(time.perf_counter() - start)
  dist.barrier()
  with open(a.out, 'w') as f:
    json.dump({'rank': a.rank, 'pid': os.getpid(), 'times_s': times,
               'torch': torch.__version__}, f)
  dist.destroy_process_group()


if __name__ == '__main__':
  main()
