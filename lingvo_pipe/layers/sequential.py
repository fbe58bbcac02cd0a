"""Layer stacks: a list of different layers, or one layer repeated.

A pipeline cuts a model into stages at layer boundaries, and a stage is a
stack of consecutive layers; cells and blocks inside a model are stacks too.
Both follow the package's chaining rule:

    args = inputs
    for layer in layers:
      out = layer.FProp(theta_i, *args)
      args = out if isinstance(out, tuple) else (out,)   # tuple → positional
    return out

so a Transformer layer returning `(x, paddings)` feeds the next one two
inputs, while a NestedMap (or any non-tuple) passes through as one input.
FPropMeta chains the children's FPropMeta the same way and sums their costs
(flops, parameter bytes and output bytes: every intermediate activation is
real memory while the stack runs).
"""

from __future__ import annotations

from typing import Any, Sequence

from lingvo_pipe.core import base_layer
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.nested_map import NestedMap


def chain_fprop(layers: Sequence[base_layer.BaseLayer],
                thetas: Sequence[NestedMap], inputs: tuple[Any, ...]) -> Any:
  """Runs `layers` in order under the tuple-chaining rule; the last output."""
  args, out = inputs, None
  for layer, theta in zip(layers, thetas):
    out = layer.FProp(theta, *args)
    args = out if isinstance(out, tuple) else (out,)
  return out


def chain_fprop_meta(params_list: Sequence[Params], names: Sequence[str],
                     input_shapes: tuple[Any, ...]) -> base_layer.LayerMeta:
  """Chains the FPropMeta of `params_list` (named `names` in errors)."""
  meta: base_layer.LayerMeta | None = None
  shapes = input_shapes
  for sub, name in zip(params_list, names):
    q = sub.Copy()
    q.name = name
    m = q.cls.FPropMeta(q, *shapes)
    meta = m if meta is None else meta + m
    shapes = m.out_shapes
  if meta is None:
    raise base_layer.LayerError(
        f'chain_fprop_meta got no layers (names {list(names)}); a stack needs '
        'at least one layer.')
  return meta


def _check_layer_params(where: str, key: str, p: Any) -> None:
  if not (isinstance(p, InstantiableParams) and isinstance(p.cls, type) and
          issubclass(p.cls, base_layer.BaseLayer)):
    raise base_layer.LayerError(
        f'{where}: {key} must hold layer Params (SomeLayer.Params()), got '
        f'{type(p).__name__}: {p!r}.')


class SequentialLayer(base_layer.BaseLayer):
  """Children `sub[0]`, `sub[1]`, ... applied in order (see module docstring).

  >>> import tensorflow as tf
  >>> from lingvo_pipe.layers import linear
  >>> fc = linear.FCLayer.Params().Set(input_dim=4, output_dim=4)
  >>> p = SequentialLayer.Params().Set(name='mlp', sub=[fc, fc.Copy()])
  >>> mlp = p.Instantiate()
  >>> mlp.FProp(mlp.theta, tf.ones([2, 4])).shape
  TensorShape([2, 4])
  """

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('sub', [], 'Layer Params of the children, in application order.')
    return p

  @classmethod
  def _Validate(cls, where: str, p: Params) -> None:
    if not isinstance(p.sub, (list, tuple)) or not p.sub:
      raise base_layer.LayerError(
          f'{where}: sub must be a non-empty list of layer Params, got '
          f'{p.sub!r}; use IdentityLayer for a stack that does nothing.')
    for i, sub in enumerate(p.sub):
      _check_layer_params(where, f'sub[{i}]', sub)

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    self._Validate(self.path, self.params)
    self.CreateChildren('sub', list(self.params.sub))

  def FProp(self, theta: NestedMap, *inputs: Any) -> Any:
    return chain_fprop(self.children.sub, theta.sub, inputs)

  @classmethod
  def FPropMeta(cls, p: Params, *input_shapes: Any) -> base_layer.LayerMeta:
    cls._Validate(p.name, p)
    names = [f'{p.name}.sub[{i}]' for i in range(len(p.sub))]
    return chain_fprop_meta(p.sub, names, input_shapes)


class RepeatLayer(base_layer.BaseLayer):
  """`repeat` copies of `body` (own weights each), applied in order.

  Children are `body[0]` ... `body[repeat-1]`; theta.body is their list.
  """

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = super().Params()
    p.Define('body', None, 'Layer Params of one repetition.')
    p.Define('repeat', 1, 'Number of repetitions (each has its own weights).')
    return p

  @classmethod
  def _Validate(cls, where: str, p: Params) -> None:
    _check_layer_params(where, 'body', p.body)
    if not isinstance(p.repeat, int) or p.repeat < 1:
      raise base_layer.LayerError(
          f'{where}: repeat must be an int ≥ 1, got {p.repeat!r}; set '
          'p.repeat to the number of copies of p.body.')

  def __init__(self, params: InstantiableParams) -> None:
    super().__init__(params)
    p = self.params
    self._Validate(self.path, p)
    self.CreateChildren('body', [p.body] * p.repeat)

  def FProp(self, theta: NestedMap, *inputs: Any) -> Any:
    return chain_fprop(self.children.body, theta.body, inputs)

  @classmethod
  def FPropMeta(cls, p: Params, *input_shapes: Any) -> base_layer.LayerMeta:
    cls._Validate(p.name, p)
    names = [f'{p.name}.body[{i}]' for i in range(p.repeat)]
    return chain_fprop_meta([p.body] * p.repeat, names, input_shapes)
