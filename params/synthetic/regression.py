"""An MLP regressing y = tanh(x·W) + noise, pipelined over 2 stages.

Small enough that a few hundred steps take seconds on a laptop CPU; the
binaries' end-to-end tests train it. In the default 300 steps the dev loss
falls from about 1.8 to about 0.06 (the noise floor is 0.05² = 0.0025).
"""

from lingvo_pipe.core import base_model
from lingvo_pipe.core import model_registry
from lingvo_pipe.tasks.synthetic import input_generator
from lingvo_pipe.tasks.synthetic import model

_INPUT_DIM = 16
_OUTPUT_DIM = 4
_BATCH_SIZE = 32


def _input(split: str, num_examples: int):
  return input_generator.SyntheticRegressionInput.Params().Set(
      name=f'synthetic_{split}', split=split, num_examples=num_examples,
      batch_size=_BATCH_SIZE, input_dim=_INPUT_DIM, output_dim=_OUTPUT_DIM)


@model_registry.RegisterSingleTaskModel
class MlpRegression(base_model.SingleTaskModelParams):
  """(FC-ReLU-BN)×2 then FC; 2 stages × 4 micro-batches; Adam, cosine."""

  def Train(self):
    return _input('train', 2048)

  def Dev(self):
    return _input('dev', 200)  # Not a multiple of 32: a partial last batch.

  def Test(self):
    return _input('test', 500)

  def Task(self):
    p = model.RegressionTask.Params().Set(name='regression')
    p.pipeline.Set(
        name='mlp',
        layers=model.mlp_layers(_INPUT_DIM, [32, 32], _OUTPUT_DIM),
        num_stages=2,
        num_micro_batches=4,
        input_shapes=[[_BATCH_SIZE, _INPUT_DIM]])
    p.train.Set(
        optimizer='adam',
        learning_rate=1e-2,
        lr_schedule='cosine',
        lr_warmup_steps=10,
        max_steps=300,
        save_interval_steps=100,
        summary_interval_steps=10)
    return p
