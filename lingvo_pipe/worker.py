"""One task of a multi-process run: the trainer, on its share of a cluster.

    # On each host (or via `python -m lingvo_pipe.launch` on one host):
    python -m lingvo_pipe.worker --model=image.fashion_mnist.AmoebaNetGPipe \\
        --logdir=/shared/run --cluster_spec=worker=h1:2222,h2:2222 --task=0

It takes every flag of the trainer (`lingvo_pipe.trainer --help`); the
cluster comes from `--cluster_spec` (Lingvo's `job=host:port,...`) with
`--task`, or from TensorFlow's `TF_CONFIG`. With K pipeline stages
(`task.pipeline.num_stages`) and K×R tasks, task i runs stage i mod K of
replica i div K. Every task must see the same --logdir (a shared file
system when the tasks run on several hosts): task 0 writes params.txt, the
summaries and the checkpoint state file; the tasks of replica 0 each write
their stage's checkpoint shard. Without a cluster it is the trainer.
"""

# pylint: disable=g-bad-import-order,g-import-not-at-top
import sys

from lingvo_pipe import _signals

if __name__ == '__main__':  # Before anything imports TensorFlow.
  _signals.exit_on_signals('worker', _signals.STARTUP)
  from lingvo_pipe import _startup
  _startup.import_tensorflow(sys.argv)

from lingvo_pipe import _cli
from lingvo_pipe import trainer


def run() -> None:
  """Console-script entry point (`lingvo_pipe_worker`)."""
  _cli.run_binary(trainer._main, 'worker', trainer)  # pylint: disable=protected-access


if __name__ == '__main__':
  run()
