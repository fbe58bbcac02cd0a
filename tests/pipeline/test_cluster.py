"""Tests of lingvo_pipe.pipeline.cluster: stages on separate TF processes.

Each case runs in a fresh Python process, because pinning the client and
connecting it to a cluster are one-time, process-wide TensorFlow settings
(this pytest process already runs TF on 4 logical devices).
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from lingvo_pipe.pipeline import cluster


def _python(code: str) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, '-c', textwrap.dedent(code)], capture_output=True,
      text=True, timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'))


def test_client_stage_plus_worker_stage_trains_like_one_device():
  proc = _python("""
      from lingvo_pipe.pipeline import cluster
      cluster.pin_client([0])
      import tensorflow as tf
      from lingvo_pipe.core import gpipe
      from lingvo_pipe.pipeline import transparency
      from lingvo_pipe.layers import linear, normalization
      layers = []
      for i in range(4):
        layers.append(linear.FCLayer.Params().Set(
            name=f'fc{i}', input_dim=8, output_dim=8, activation='RELU'))
      layers.insert(2, normalization.BatchNormLayer.Params().Set(
          name='bn', dim=8))
      with cluster.LocalCluster(1, first_core=1) as c:
        print('worker pid', c.pids[0], flush=True)
        p = gpipe.PipeliningLayer.Params().Set(
            name='pipe', layers=layers, num_stages=2, split_points=[2],
            num_micro_batches=4,
            devices=[c.client_device] + c.devices)
        x = tf.random.stateless_normal([16, 8], seed=[1, 2])
        report = transparency.check_transparency(
            p, (x,), micro_batched_reference=True)
        net_devices = sorted({v.device for v in
                              p.Instantiate().trainable_variables})
        print('devices', net_devices)
        print('report', report.ok(), report)
      """)
  assert proc.returncode == 0, proc.stderr[-3000:]
  pid = int(re.search(r'worker pid (\d+)', proc.stdout).group(1))
  with pytest.raises(ProcessLookupError):
    os.kill(pid, 0)  # Stopped by PID on exit.
  assert '/job:worker/replica:0/task:0' in proc.stdout  # Stage 1's weights.
  assert '/job:localhost/replica:0/task:0' in proc.stdout  # Stage 0's.
  assert 'report True' in proc.stdout, proc.stdout


def test_pin_client_after_the_runtime_started_says_when_to_call_it():
  proc = _python("""
      import tensorflow as tf
      tf.constant(1.0) + 1.0  # Starts the runtime.
      from lingvo_pipe.pipeline import cluster
      cluster.pin_client([0])
      """)
  assert proc.returncode != 0
  assert 'ClusterError' in proc.stderr
  assert 'before any TF op' in proc.stderr


def test_a_cluster_needs_at_least_one_worker():
  with pytest.raises(cluster.ClusterError, match='num_workers=0'):
    cluster.LocalCluster(0)
