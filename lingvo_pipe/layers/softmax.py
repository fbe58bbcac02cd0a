"""Output projection to class logits, and label-smoothed cross-entropy.

`SoftmaxLayer` maps features [..., D] to logits [..., V]. For deep
Transformers GPipe clipped the logits (softmax pre-activations) whose
magnitudes exceeded a bound, which kept training stable; `logits_abs_max`
caps logits to [-c, c] (0 disables).

The loss is a pure function of logits, so the layer stays a projection and a
task decides how to reduce it:

  * `softmax_cross_entropy(logits, class_ids, label_smoothing, weights)` gives
    the loss at every position.
  * `mean_softmax_cross_entropy(...)` gives `(mean loss, total weight)`, the
    `(value, weight)` pair of the BaseTask metric convention.

Label smoothing with ε: the target distribution puts 1 − ε on the label and
ε / (V − 1) on each of the other V − 1 classes (tensor2tensor's convention),
so it sums to 1 and the label always keeps the largest share. The loss is the
plain cross-entropy −Σ target·log p; its minimum is the entropy of the target,
not 0. Losses are computed in float32 whatever the logits' dtype.

Cost convention (FPropMeta): 2 flops per multiply-add of the projection, 1 per
logit for the bias and 1 per logit for the clipping.
"""

from __future__ import annotations

import tensorflow as tf

from lingvo_pipe.core import base_layer
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.nested_map import NestedMap

LayerError = base_layer.LayerError


class SoftmaxLayer(base_layer.BaseLayer):
  """Logits [..., num_classes] = x [..., input_dim] · w (+ b), maybe clipped.

  >>> p = SoftmaxLayer.Params().Set(name='softmax', input_dim=4,
  ...                               num_classes=10, logits_abs_max=30.0)
  >>> layer = p.Instantiate()
  >>> logits = layer.FProp(layer.theta, tf.ones([2, 3, 4]))  # [2, 3, 10]
  >>> xent = softmax_cross_entropy(logits, tf.zeros([2, 3], tf.int32), 0.1)
  """

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('input_dim', 0, 'Depth D of the input features.')
    p.Define('num_classes', 0, 'Number of classes V (vocabulary size).')
    p.Define('has_bias', True, 'Add a learned bias per class.')
    p.Define('logits_abs_max', 0.0, 'Clip logits to [-c, c] with this c; 0 '
             'disables. GPipe clipped logits to keep deep Transformers '
             'stable.')
    return p

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    _check_params(self.path, self.params)
    p = self.params
    self.CreateVariable(
        'w', base_layer.WeightParams([p.input_dim, p.num_classes]))
    if p.has_bias:
      self.CreateVariable('b', base_layer.WeightParams(
          [p.num_classes], base_layer.WeightInit.Constant(0.0)))

  def FProp(self, theta: NestedMap, x: tf.Tensor) -> tf.Tensor:
    """Computes logits.

    Args:
      theta: NestedMap with `w` [D, V] and, with has_bias, `b` [V].
      x: [..., D] features.

    Returns:
      [..., V] logits in fprop_dtype.

    Raises:
      LayerError: if x's last dim is not input_dim.
    """
    p = self.params
    x = tf.cast(x, self.fprop_dtype)
    if x.shape[-1] is not None and x.shape[-1] != p.input_dim:
      raise LayerError(f'{self.path}: input last dim {x.shape[-1]} != '
                       f'input_dim {p.input_dim}; set p.input_dim to the '
                       'feature depth.')
    w = tf.cast(theta.w, self.fprop_dtype)
    logits = tf.tensordot(x, w, axes=[[x.shape.rank - 1], [0]])  # [..., V]
    if p.has_bias:
      logits += tf.cast(theta.b, self.fprop_dtype)
    if p.logits_abs_max > 0:
      c = tf.cast(p.logits_abs_max, self.fprop_dtype)
      logits = tf.clip_by_value(logits, -c, c)
    return logits

  @classmethod
  def FPropMeta(cls, p: Params, x: tf.TensorShape) -> base_layer.LayerMeta:
    _check_params(p.name, p)
    x = tf.TensorShape(x)
    if x.rank is None or x[-1] != p.input_dim:
      raise LayerError(f'{p.name}: input last dim of {x} != input_dim '
                       f'{p.input_dim}; set p.input_dim to the feature '
                       'depth.')
    out = x[:-1].concatenate([p.num_classes])
    rows = x[:-1].num_elements() or 0
    per_logit = int(p.has_bias) + int(p.logits_abs_max > 0)
    flops = rows * p.num_classes * (2 * p.input_dim + per_logit)
    num_params = p.input_dim * p.num_classes + (p.num_classes
                                                if p.has_bias else 0)
    return base_layer.LayerMeta.build(
        p, flops=flops, out_shapes=(out,), num_params=num_params)


def _check_params(where: str, p: Params) -> None:
  for name, fix in (('input_dim', 'the feature depth'),
                    ('num_classes', 'the number of classes')):
    value = getattr(p, name)
    if not isinstance(value, int) or value <= 0:
      raise LayerError(f'{where}: {name} must be an int > 0, got {value!r}; '
                       f'set p.{name} to {fix}.')
  if p.logits_abs_max < 0:
    raise LayerError(f'{where}: logits_abs_max must be >= 0, got '
                     f'{p.logits_abs_max}; use 0 to disable clipping.')


def softmax_cross_entropy(logits: tf.Tensor, class_ids: tf.Tensor,
                          label_smoothing: float = 0.0,
                          weights: tf.Tensor | None = None) -> tf.Tensor:
  """Label-smoothed cross-entropy at every position.

  Args:
    logits: [..., V] unnormalised log-probabilities.
    class_ids: [...] int labels in [0, V). An id outside that range gets an
      all-zero one-hot row (no error, as in Lingvo): give it weight 0.
    label_smoothing: ε in [0, 1): the label gets 1 − ε, every other class
      ε / (V − 1).
    weights: optional [...] per-position weights (e.g. 1 − paddings); the
      loss is multiplied by them.

  Returns:
    [...] float32 losses (× weights when given).

  Raises:
    LayerError: if label_smoothing is outside [0, 1) or V < 2 with smoothing.
  """
  if not 0.0 <= label_smoothing < 1.0:
    raise LayerError(f'softmax_cross_entropy: label_smoothing must be in '
                     f'[0, 1), got {label_smoothing}; 0.1 is the '
                     'Transformer\'s value.')
  log_probs = tf.nn.log_softmax(tf.cast(logits, tf.float32))  # [..., V]
  num_classes = log_probs.shape[-1]
  depth = tf.shape(log_probs)[-1]
  labels = tf.one_hot(class_ids, depth, dtype=tf.float32)  # [..., V]
  nll = -tf.reduce_sum(labels * log_probs, axis=-1)  # [...]
  if label_smoothing > 0:
    if num_classes is not None and num_classes < 2:
      raise LayerError('softmax_cross_entropy: label smoothing needs at least '
                       f'2 classes, got {num_classes}; set it to 0.')
    num = tf.cast(depth, tf.float32)
    off = label_smoothing / (num - 1.0)
    # Σ_c target_c·(−log p_c) = (1−ε−off)·nll + off·Σ_c(−log p_c).
    loss = (1.0 - label_smoothing - off) * nll - off * tf.reduce_sum(
        log_probs, axis=-1)
  else:
    loss = nll
  if weights is not None:
    loss *= tf.cast(weights, tf.float32)
  return loss


def mean_softmax_cross_entropy(logits: tf.Tensor, class_ids: tf.Tensor,
                               weights: tf.Tensor | None = None,
                               label_smoothing: float = 0.0
                              ) -> tuple[tf.Tensor, tf.Tensor]:
  """(Σ weights·loss / Σ weights, Σ weights): a BaseTask `(value, weight)`.

  Args:
    logits: [..., V] logits.
    class_ids: [...] int labels.
    weights: optional [...] weights (1 − paddings); None weighs all 1.
    label_smoothing: see `softmax_cross_entropy`.

  Returns:
    (mean loss, total weight), float32 scalars. With total weight 0 the mean
    is 0, not NaN.
  """
  if weights is None:
    weights = tf.ones(tf.shape(class_ids), tf.float32)
  weights = tf.cast(weights, tf.float32)
  total = tf.reduce_sum(softmax_cross_entropy(logits, class_ids,
                                              label_smoothing, weights))
  weight = tf.reduce_sum(weights)
  return tf.math.divide_no_nan(total, weight), weight
