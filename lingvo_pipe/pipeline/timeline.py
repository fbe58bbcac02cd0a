"""Pictures of one pipelined step: measured, predicted, side by side.

A pipeline's promise is a picture — stage k runs micro-batch m+1 while stage
k+1 runs m — and its failures are pictures too: a stage that waits for a
transfer, a backward that starts late, a recompute that runs too early. This
module makes those pictures from two sources that share one record shape,
`(stage, micro_batch, kind, start, end)` with times in seconds:

* measured: the engine brackets every forward 'F', recompute 'R' and
  backward 'B' with `tf.timestamp()` when `fprop_context.scope(timeline=[])`
  is open (`record_step` / `StepRecorder` do that and return the records);
* predicted: `simulator.simulate(...).events`, with stage costs calibrated
  from the measured op durations (`calibrated_costs`), so the two panels
  differ only where the real step departs from the schedule (transfers,
  dispatch gaps, noise). `step_gaps` measures those gaps in a recorded
  step and replays the schedule with them added back.

Outputs: Chrome-trace JSON (chrome://tracing or ui.perfetto.dev; one
process per panel, one thread per stage, events named 'F3', 'R3', 'B3') and
a PNG Gantt chart, one row per stage as in the GPipe paper's Figure 2.

    recorder = StepRecorder(net, (x,), loss_fn)
    recorder()                                    # traces; warm-up
    measured = recorder()
    predicted = simulator.simulate(calibrated_costs(measured),
                                   num_micro_batches=4).events
    plot_gantt([('measured', measured), ('predicted', predicted)], 'a.png')
"""

from __future__ import annotations

import collections
import json
import statistics
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import tensorflow as tf

from lingvo_pipe import errors
from lingvo_pipe.core import fprop_context
from lingvo_pipe.pipeline import simulator

__all__ = ['KINDS', 'Record', 'RecordBatch', 'StepRecorder', 'TimelineError',
           'from_stamps', 'stamps',
           'calibrated_costs', 'normalized', 'overlap_fraction',
           'plot_gantt',
           'record_step',
           'to_chrome_trace', 'write_chrome_trace']

KINDS = ('F', 'R', 'B', 'I', 'W')  # I, W: a split backward (zero bubble).
_COLORS = {'F': '#4C72B0', 'R': '#DD8452', 'B': '#55A868', 'I': '#8172B3',
           'W': '#CCB974'}
_NAMES = {'F': 'forward', 'R': 'recompute', 'B': 'backward',
          'I': 'input gradient', 'W': 'weight gradient'}


class TimelineError(errors.LingvoPipeError):
  """Records or settings that cannot be drawn; the message says the fix."""


class Record(NamedTuple):
  """One op of a step; the same fields as `simulator.Event`."""
  stage: int
  micro_batch: int
  kind: str  # One of KINDS.
  start: float  # Seconds.
  end: float


class RecordBatch(NamedTuple):
  """The records of a loop, as the engine's sink holds them: `values`
  [iterations, len(keys), 3] holds (micro-batch, start, end) of each
  (stage, kind) of `keys`, per iteration."""
  keys: list[tuple[int, str]]
  values: tf.Tensor
  count: int  # Iterations.


def stamps(sink: Sequence[Any]) -> tuple[list[Any], tf.Tensor]:
  """A recorded step's sink (records, and record batches of loops) as
  (keys, an [N, 3] float64 tensor of (micro-batch, start, end)): what a
  traced step returns, read back by `from_stamps`."""
  keys: list[Any] = []
  parts = []
  for entry in sink:
    if isinstance(entry, RecordBatch):
      keys += [key for _ in range(entry.count) for key in entry.keys]
      parts.append(tf.reshape(entry.values, [-1, 3]))
    else:
      stage, m, kind, start, end = entry
      keys.append((int(stage), str(kind)))
      parts.append(tf.reshape(tf.stack(
          [tf.cast(m, tf.float64), start, end]), [1, 3]))
  values = tf.concat(parts, 0) if parts else tf.zeros([0, 3], tf.float64)
  return keys, values


def from_stamps(keys: Sequence[Any], values: Any) -> list[Record]:
  """Records from `stamps`'s keys and its tensor's value (numpy)."""
  return [Record(stage, int(m), kind, float(start), float(end))
          for (stage, kind), (m, start, end) in zip(keys, values)]


def _checked(records: Iterable[Any]) -> list[Record]:
  out = []
  for i, r in enumerate(records):
    rec = Record(*r)
    if rec.kind not in KINDS:
      raise TimelineError(f'Record {i} {tuple(r)!r} has kind {rec.kind!r}; '
                          f'kinds are {KINDS}.')
    if not rec.end >= rec.start:
      raise TimelineError(f'Record {i} {tuple(r)!r} ends before it starts; '
                          'give (stage, micro_batch, kind, start, end).')
    out.append(rec)
  return out


def normalized(records: Iterable[Any]) -> list[Record]:
  """Records shifted so that the earliest start is 0, sorted by start."""
  recs = _checked(records)
  t0 = min((r.start for r in recs), default=0.0)
  return sorted((r._replace(start=r.start - t0, end=r.end - t0)
                 for r in recs), key=lambda r: (r.start, r.stage))


# ---- Measuring ------------------------------------------------------------
class StepRecorder:
  """A compiled training step that returns the engine's timestamps.

  Each call runs one training step inside one `tf.function` and returns its
  records (normalized to start at 0 unless `normalize=False`: stage
  processes keep absolute seconds, which one host's processes share). Two
  forms:

  * `labels` None: `loss_fn(net.FProp(...))` → scalar loss, and
    `tape.gradient` (GPipe only: the loss is outside the pipeline);
  * `labels` given: `net.FPropLoss(theta, inputs, labels, loss_fn)`, the
    loss in the last stage, so any schedule (1F1B, interleaved); `loss_fn`
    is then (outputs, labels) → {'loss': (value, weight), ...}.

  `update(variables, grads)`, if given, runs in the step. The first call
  traces; time the later ones. In a stage process the records are this
  process's stages only.
  """

  def __init__(self, net: Any, inputs: Sequence[Any],
               loss_fn: Callable[..., Any], step: int = 0,
               update: Callable[[list[Any], list[tf.Tensor]], Any] | None
               = None, labels: Any = None, normalize: bool = True) -> None:
    self._keys: list[Any] = []
    self._normalize = normalize
    variables = list(net.trainable_variables)

    @tf.function
    def _step() -> tf.Tensor:
      timeline: list[Any] = []
      with tf.GradientTape() as tape:
        with fprop_context.scope(training=True, step=step, timeline=timeline):
          if labels is None:
            loss = loss_fn(net.FProp(net.theta, *inputs))
          else:
            loss = net.FPropLoss(net.theta, tuple(inputs), labels,
                                 loss_fn)['loss'][0]
      grads = tape.gradient(loss, variables)
      if update is not None:
        update(variables, grads)
      if not timeline:
        raise TimelineError(
            f'{net.path}: the step recorded no ops; StepRecorder needs a '
            'PipeliningLayer (or a layer that runs one) as `net`.')
      self._keys, values = stamps(timeline)
      with tf.control_dependencies(
          [g for g in grads if g is not None] + [loss]):
        return tf.identity(values)

    self._fn = _step

  def __call__(self) -> list[Record]:
    values = self._fn().numpy()  # Traces first: that sets the keys.
    records = from_stamps(self._keys, values)
    return normalized(records) if self._normalize else _checked(records)


def record_step(net: Any, inputs: Sequence[Any],
                loss_fn: Callable[[Any], tf.Tensor], step: int = 0,
                warmup_steps: int = 1) -> list[Record]:
  """Runs `warmup_steps` + 1 recorded steps; returns the last one's records.

  Args:
    net: a PipeliningLayer.
    inputs: its positional inputs for one mini-batch.
    loss_fn: outputs → scalar loss.
    step: the training step (seeds dropout).
    warmup_steps: untimed calls first (the first one traces the graph).

  Returns:
    One Record per forward, recompute and backward of every (stage,
    micro-batch), times in seconds from the first op's start.
  """
  recorder = StepRecorder(net, inputs, loss_fn, step)
  for _ in range(warmup_steps):
    recorder()
  return recorder()


# ---- Predicting -----------------------------------------------------------
def calibrated_costs(records: Iterable[Any],
                     dispatch_s: float = 0.0) -> list[simulator.StageCost]:
  """Per-stage StageCosts from the median measured F, R, B, I and W
  durations, each + `dispatch_s` (e.g. the step's mean dispatch gap,
  `step_gaps.gaps`).

  A stage without 'R' records gets recompute = forward (the simulator's
  default), which is only used if the simulated policy recomputes. A split
  stage (I and W records, no B) gets backward = I + W; a stage with B only
  gets the simulator's I/W halves (used if the simulated schedule splits).
  """
  recs = _checked(records)
  if not recs:
    raise TimelineError('No records to calibrate from; record a step first.')
  num_stages = max(r.stage for r in recs) + 1
  costs = []
  for k in range(num_stages):
    med = {}
    for kind in KINDS:
      d = [r.end - r.start for r in recs if r.stage == k and r.kind == kind]
      med[kind] = statistics.median(d) + dispatch_s if d else None
    split = med['I'] is not None and med['W'] is not None
    if med['F'] is None or (med['B'] is None and not split):
      raise TimelineError(f'Stage {k} has no F or no B (or I and W) '
                          'records; give the records of a whole training '
                          'step.')
    if med['B'] is None:
      med['B'] = med['I'] + med['W']
    costs.append(simulator.StageCost(
        forward=med['F'], backward=med['B'], recompute=med['R'],
        input_grad=med['I'] if split else None,
        weight_grad=med['W'] if split else None))
  return costs


def overlap_fraction(records: Iterable[Any]) -> float:
  """Share of the stages' busy time during which another stage is busy too.

  0 means the stages took turns (no pipelining at all); a GPipe step of K
  equal stages and M micro-batches without transfer gaps predicts about
  1 - 1/M at K=2. Compare a measured step with its simulated twin.
  """
  recs = _checked(records)
  edges = sorted([(r.start, 1, r.stage) for r in recs] +
                 [(r.end, -1, r.stage) for r in recs])
  busy: dict[int, int] = {}
  total = shared = 0.0
  last = edges[0][0] if edges else 0.0
  for t, delta, stage in edges:  # Ends sort before starts at equal times.
    active = sum(1 for n in busy.values() if n > 0)
    total += (t - last) * active
    shared += (t - last) * active if active >= 2 else 0.0
    busy[stage] = busy.get(stage, 0) + delta
    last = t
  return shared / total if total > 0 else 0.0


# ---- Chrome trace -----------------------------------------------------------
def to_chrome_trace(panels: Sequence[tuple[str, Iterable[Any]]]
                   ) -> dict[str, Any]:
  """Chrome-trace JSON: one process per panel, one thread per stage.

  Args:
    panels: (name, records) pairs, e.g. [('measured', recs), ('predicted',
      sim.events)]; times in seconds.

  Returns:
    {'traceEvents': [...], 'displayTimeUnit': 'ms'}; complete events ('X')
    named like 'F3' with ts/dur in microseconds, plus metadata ('M') events
    naming processes and threads.
  """
  events: list[dict[str, Any]] = []
  for pid, (name, records) in enumerate(panels, start=1):
    recs = normalized(records)
    events.append({'ph': 'M', 'name': 'process_name', 'pid': pid, 'tid': 0,
                   'args': {'name': name}})
    for k in sorted({r.stage for r in recs}):
      events.append({'ph': 'M', 'name': 'thread_name', 'pid': pid, 'tid': k,
                     'args': {'name': f'stage {k}'}})
      events.append({'ph': 'M', 'name': 'thread_sort_index', 'pid': pid,
                     'tid': k, 'args': {'sort_index': k}})
    for r in recs:
      events.append({
          'ph': 'X', 'name': f'{r.kind}{r.micro_batch}', 'cat': _NAMES[r.kind],
          'pid': pid, 'tid': r.stage, 'ts': r.start * 1e6,
          'dur': (r.end - r.start) * 1e6,
          'args': {'stage': r.stage, 'micro_batch': r.micro_batch}})
  return {'traceEvents': events, 'displayTimeUnit': 'ms'}


def write_chrome_trace(path: str,
                       panels: Sequence[tuple[str, Iterable[Any]]]) -> None:
  """Writes `to_chrome_trace(panels)` to `path`."""
  with open(path, 'w') as f:
    json.dump(to_chrome_trace(panels), f)


# ---- Gantt chart ----------------------------------------------------------
def plot_gantt(panels: Sequence[tuple[str, Iterable[Any]]], path: str,
               title: str = '', share_time_axis: bool = True,
               num_devices: int | None = None,
               stage_devices: Sequence[int] | None = None,
               panel_devices: Sequence[Sequence[int] | None] | None = None
               ) -> None:
  """A PNG Gantt chart: one panel per (name, records), one row per stage.

  Boxes are coloured by kind (forward, recompute, backward) and labelled with
  the micro-batch index where they are wide enough; time is in ms from the
  panel's first op. Stage 0 is the top row, so GPipe's fill shows as a
  diagonal running down and to the right.

  With `num_devices` = K, the rows are devices instead: stage s runs on
  device s mod K (interleaved schedules, v stages per device), and boxes
  of chunk c = s div K ≥ 1 are hatched, labelled like '3c1'. Or give the
  schedule's `stage_devices` map (zb_v's V: stage s on device map[s]);
  chunk c is then s's rank among its device's stages. `panel_devices`:
  one such map per panel (None: s mod K), for panels of schedules that
  place stages differently.
  """
  import matplotlib  # Late: only the pictures need it.
  matplotlib.use('Agg')
  from matplotlib import patches
  from matplotlib import pyplot as plt

  data = [(name, normalized(recs)) for name, recs in panels]
  if not data or not any(recs for _, recs in data):
    raise TimelineError('plot_gantt got no records; give (name, records) '
                        'pairs with at least one record.')
  num_stages = max(r.stage for _, recs in data for r in recs) + 1
  maps = list(panel_devices or [stage_devices] * len(data))
  if stage_devices is not None or any(maps):
    num_devices = max(len(set(m)) for m in maps if m)
  if num_devices is not None and not 1 <= num_devices <= num_stages:
    raise TimelineError(f'num_devices={num_devices!r}: give K, 1 ≤ K ≤ '
                        f'{num_stages} (the records have {num_stages} '
                        'stages).')
  rows = num_devices or num_stages
  fig, axes = plt.subplots(
      len(data), 1, sharex=share_time_axis, squeeze=False,
      figsize=(11, 0.5 + len(data) * (0.9 + 0.45 * rows)))
  span = max((r.end for _, recs in data for r in recs), default=1.0) * 1e3
  for ax, (name, recs), devices in zip(axes[:, 0], data, maps):
    stages = max((r.stage for r in recs), default=0) + 1
    _draw_panel(ax, name, recs, rows, span, num_devices is not None,
                _placement(stages, num_devices, devices))
  axes[-1, 0].set_xlabel('time (ms)')
  kinds = [k for k in KINDS if any(r.kind == k for _, rs in data for r in rs)]
  fig.legend(handles=[patches.Patch(color=_COLORS[k], label=_NAMES[k])
                      for k in kinds], loc='upper right', ncol=len(kinds),
             frameon=False)
  if title:
    fig.suptitle(title, x=0.01, ha='left', fontsize=11)
  fig.tight_layout(rect=(0, 0, 1, 0.94))
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _placement(num_stages: int, num_devices: int | None,
               stage_devices: Sequence[int] | None
               ) -> dict[int, tuple[int, int]] | None:
  """Stage → (device row, chunk): from the map, else s mod K."""
  if num_devices is None:
    return None
  if stage_devices is None:
    return {s: (s % num_devices, s // num_devices) for s in range(num_stages)}
  if len(stage_devices) < num_stages:
    raise TimelineError(f'stage_devices={tuple(stage_devices)} places '
                        f'{len(stage_devices)} stages; the records have '
                        f'{num_stages}.')
  seen: dict[int, int] = collections.Counter()
  out = {}
  for s, d in enumerate(stage_devices):
    out[s] = (d, seen[d])
    seen[d] += 1
  return out


def _draw_panel(ax: Any, name: str, recs: list[Record], num_rows: int,
                span_ms: float, by_device: bool = False,
                placed: dict[int, tuple[int, int]] | None = None) -> None:
  """One panel: a row per stage (or device), a labelled box per record."""
  end_ms = max((r.end for r in recs), default=0.0) * 1e3
  ax.set_title(f'{name} — step {end_ms:.1f} ms', loc='left', fontsize=10)
  for r in recs:
    x, w = r.start * 1e3, (r.end - r.start) * 1e3
    row, chunk = placed[r.stage] if by_device and placed else (r.stage, 0)
    ax.broken_barh([(x, w)], (row - 0.4, 0.8),
                   facecolors=_COLORS[r.kind], edgecolor='white',
                   linewidth=0.6, hatch='///' if chunk else None)
    label = f'{r.micro_batch}c{chunk}' if chunk else str(r.micro_batch)
    if w > span_ms / 110 * len(label):  # Room for a label.
      ax.text(x + w / 2, row, label, ha='center', va='center',
              color='white', fontsize=7, fontweight='bold')
  ax.set_yticks(range(num_rows))
  ax.set_yticklabels([f'{"device" if by_device else "stage"} {k}'
                      for k in range(num_rows)])
  ax.set_ylim(num_rows - 0.5, -0.5)  # Stage 0 on top.
  ax.grid(axis='x', alpha=0.3)
  ax.set_axisbelow(True)
