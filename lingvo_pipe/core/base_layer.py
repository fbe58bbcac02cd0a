"""The layer contract: Params, eager variables, a stateless FProp, FPropMeta.

A layer is built from its Params, creates all of its variables in
`__init__` (nothing is lazy, so a partitioner can place a layer's variables on
its stage's device before any data flows), and computes with

    outputs = layer.FProp(layer.theta, *inputs)

where `theta` is a NestedMap of the layer's variables mirroring its child
tree. FProp reads nothing else (the call-level facts a few layers need are in
`fprop_context`), so the pipeline can run it once per micro-batch and again in
the backward pass and get the same answer.

`FPropMeta(p, *input_shapes)` is a classmethod: the partitioner and simulator
ask what a layer *would* cost (flops, output shapes, parameter and activation
bytes) without building it.

Initial values are a pure function of `random_seed` and the layer's path
(e.g. 'model.layers[3].w'), so the same Params give the same weights however
the model is later cut into stages.

A custom layer needs only this module:

    class Scale(base_layer.BaseLayer):
      @classmethod
      def Params(cls):
        p = super().Params()
        p.Define('dim', 0, 'Feature depth.')
        return p

      def __init__(self, params):
        super().__init__(params)
        self.CreateVariable('s', base_layer.WeightParams(
            [self.params.dim], base_layer.WeightInit.Constant(1.0)))

      def FProp(self, theta, x):
        return x * theta.s

      @classmethod
      def FPropMeta(cls, p, x):
        return base_layer.LayerMeta.build(
            p, flops=x.num_elements(), out_shapes=(x,), num_params=p.dim)
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import re
import threading
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import tensorflow as tf

from lingvo_pipe import errors
from lingvo_pipe.core import fprop_context
from lingvo_pipe.core import weight_init
from lingvo_pipe.core.fprop_context import FPropContext, StatsCollector
from lingvo_pipe.core.hyperparams import InstantiableParams, Params
from lingvo_pipe.core.nested_map import NestedMap

__all__ = [
    'BaseLayer', 'FPropContext', 'LayerError', 'LayerMeta', 'NestedMap',
    'Params', 'StatsCollector', 'WeightInit', 'WeightParams', 'fprop_context',
    'sharing_variables', 'stable_seed',
]

DEFAULT_RANDOM_SEED = 1234
WeightInit = weight_init.WeightInit
WeightParams = weight_init.WeightParams
stable_seed = weight_init.stable_seed


class LayerError(errors.LingvoPipeError):
  """Bad params or inputs for a layer; the message names the layer path."""


# ---- Cost record ------------------------------------------------------------
def _elements(shape: tf.TensorShape) -> int:
  return int(np.prod([d if d is not None else 1 for d in shape.as_list()]))


def as_shape(x: Any) -> Any:
  """Converts a shape, list of ints or nested structure of them to TensorShapes.

  None stays None: a None leaf of an input nest (Lingvo's
  `NestedMap(vec=x, paddings=None)`) is no tensor, and has no shape.
  """
  if x is None or isinstance(x, tf.TensorShape):
    return x
  if isinstance(x, (list, tuple)) and all(
      isinstance(d, (int, type(None))) for d in x):
    return tf.TensorShape(x)
  if isinstance(x, dict):
    return NestedMap({k: as_shape(v) for k, v in x.items()})
  if isinstance(x, (list, tuple)):
    return type(x)(as_shape(v) for v in x)
  return tf.TensorShape(x)


@dataclasses.dataclass(frozen=True)
class LayerMeta:
  """What one FProp costs: flops (2 × multiply-adds), output shapes, bytes.

  `out_shapes` is a tuple of (possibly nested) TensorShapes, one per positional
  input of the next layer. Unknown dimensions count as 1 in the byte totals.
  `out_dtypes` holds the dtype of each leaf of `tf.nest.flatten(out_shapes)`
  (empty: unknown); a stage process receives its input by these shapes and
  dtypes, and the conformance suite checks them against real outputs.
  """
  flops: int
  out_shapes: tuple[Any, ...]
  param_bytes: int
  out_bytes: int
  out_dtypes: tuple[tf.DType, ...] = ()

  @staticmethod
  def build(p: Params, flops: float, out_shapes: Sequence[Any],
            num_params: int, out_dtype: Any = None) -> 'LayerMeta':
    """The meta of one layer.

    Args:
      p: the layer's Params (dtype, fprop_dtype).
      flops: 2 × multiply-adds of one FProp.
      out_shapes: one (nest of) shape(s) per output.
      num_params: parameters of the layer.
      out_dtype: the outputs' dtype: one for all, or a nest like
        `out_shapes`; default the compute dtype (fprop_dtype, else dtype).
    """
    shapes = tuple(as_shape(s) for s in out_shapes)
    leaves = tf.nest.flatten(shapes)
    default = p.fprop_dtype or p.dtype
    if out_dtype is None or isinstance(out_dtype, tf.DType):
      dtypes = [out_dtype or default] * len(leaves)
    else:
      dtypes = [tf.as_dtype(d) for d in tf.nest.flatten(out_dtype)]
      if len(dtypes) != len(leaves):
        raise LayerError(f'{p.name}: FPropMeta gave {len(dtypes)} output '
                         f'dtypes for {len(leaves)} outputs {shapes}.')
    out_bytes = sum(_elements(s) * d.size for s, d in zip(leaves, dtypes)
                    if s is not None)
    return LayerMeta(
        flops=int(flops),
        out_shapes=shapes,
        param_bytes=int(num_params) * p.dtype.size,
        out_bytes=int(out_bytes),
        out_dtypes=tuple(dtypes))

  def __add__(self, other: 'LayerMeta') -> 'LayerMeta':
    """Composition: `self` then `other` (outputs are `other`'s)."""
    return LayerMeta(self.flops + other.flops, other.out_shapes,
                     self.param_bytes + other.param_bytes,
                     self.out_bytes + other.out_bytes, other.out_dtypes)


# ---- The layer --------------------------------------------------------------
_BUILD = threading.local()

# creator(layer, name, weight params, make) -> (variable, checkpointed here?)
VariableCreator = Callable[..., tuple[tf.Variable, bool]]


@contextlib.contextmanager
def sharing_variables(creator: VariableCreator | None) -> Iterator[None]:
  """Layers built inside get their variables from `creator` (which calls
  `make()` for a variable of their own): how a pipeline ties weights
  (`core/tied_weights.py`). None: every layer makes its own, as outside."""
  saved = getattr(_BUILD, 'creator', None)
  _BUILD.creator = creator
  try:
    yield
  finally:
    _BUILD.creator = saved


def _snake_case(name: str) -> str:
  return re.sub(r'(?<!^)(?=[A-Z])', '_', name).lower()


class BaseLayer(tf.Module):
  """Base class of every layer: see the module docstring for the contract."""

  @classmethod
  def Params(cls) -> InstantiableParams:
    p = InstantiableParams(cls)
    p.Define('name', '', 'Name of this layer; its path in the model is the '
             'parent\'s path + "." + name. Defaults to the class name.')
    p.Define('dtype', tf.float32, 'Dtype of the variables.')
    p.Define('fprop_dtype', None, 'Dtype of the computation; None = the '
             'parent layer\'s fprop_dtype, else dtype.', value_type=tf.DType)
    p.Define('random_seed', None, 'Seed of the initial values; None inherits '
             f'the parent\'s ({DEFAULT_RANDOM_SEED} at the root).',
             value_type=int)
    p.Define('params_init', WeightInit.Xavier(1.0), 'Default initialiser of '
             'this layer\'s weights.')
    return p

  def __init__(self, params: InstantiableParams) -> None:
    name = params.name or _snake_case(type(self).__name__)
    super().__init__(name=re.sub(r'\W', '_', name))
    parent: BaseLayer | None = getattr(_BUILD, 'parent', None)
    child_name: str | None = getattr(_BUILD, 'child_name', None)
    # Consumed: a layer this one builds without CreateChild is a new root,
    # not a second 'parent.child_name' with the same seeds.
    _BUILD.parent = _BUILD.child_name = None
    self._params = params.Copy().Freeze()
    self._path = (f'{parent.path}.{child_name}' if parent is not None and
                  child_name else name)
    seed = params.random_seed
    if seed is None:
      seed = parent.random_seed if parent is not None else DEFAULT_RANDOM_SEED
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
      raise LayerError(f'{self._path}: random_seed={seed!r}; give an int '
                       '(or None to inherit the parent\'s).')
    self._random_seed = int(seed)
    self._private_vars = NestedMap()
    self._private_children = NestedMap()
    self._dependency_names: set[str] = set()  # Checkpoint names in use.

  # ---- Read-only facts --------------------------------------------------
  @property
  def params(self) -> InstantiableParams:
    """The frozen Params this layer was built from."""
    return self._params

  @property
  def path(self) -> str:
    """Dotted path from the root, e.g. 'model.encoder.layers[2]'."""
    return self._path

  @property
  def random_seed(self) -> int:
    return self._random_seed

  @property
  def fprop_dtype(self) -> tf.DType:
    return self._params.fprop_dtype or self._params.dtype

  @property
  def vars(self) -> NestedMap:
    """This layer's own variables (not its children's)."""
    return self._private_vars

  @property
  def children(self) -> NestedMap:
    return self._private_children

  @property
  def theta(self) -> NestedMap:
    """Variables of this layer and all children, as a NestedMap tree."""
    out = NestedMap(self._private_vars)
    for name, child in self._private_children.items():
      if isinstance(child, list):
        out[name] = [c.theta for c in child]
      else:
        out[name] = child.theta
    return out

  def Walk(self) -> Iterator['BaseLayer']:
    """This layer and every descendant, parents first."""
    yield self
    for child in self._private_children.values():
      for c in (child if isinstance(child, list) else [child]):
        yield from c.Walk()

  # ---- Building -------------------------------------------------------------
  @contextlib.contextmanager
  def _Building(self, child_name: str) -> Iterator[None]:
    saved = (getattr(_BUILD, 'parent', None), getattr(_BUILD, 'child_name',
                                                     None))
    _BUILD.parent, _BUILD.child_name = self, child_name
    try:
      yield
    finally:
      _BUILD.parent, _BUILD.child_name = saved

  def _ChildParams(self, name: str, params: InstantiableParams) -> Params:
    """A child's params: named, and computing in this layer's fprop_dtype
    unless it sets its own (as Lingvo's CopyBaseParams does)."""
    p = params.Copy()
    if not p.name:
      p.name = name
    if p.fprop_dtype is None and self._params.fprop_dtype is not None:
      p.fprop_dtype = self._params.fprop_dtype
    return p

  def CreateChild(self, name: str, params: InstantiableParams) -> 'BaseLayer':
    """Builds child `name` from `params`; it appears in theta as theta.name."""
    self._CheckNewName(name)
    with self._Building(name):
      child = self._ChildParams(name, params).Instantiate()
    self._private_children[name] = child
    self._track_trackable(child, name=name)
    return child

  def CreateChildren(self, name: str,
                     params_list: Sequence[InstantiableParams],
                     devices: Sequence[str | None] | None = None,
                     keys: Sequence[str] | None = None
                    ) -> list['BaseLayer']:
    """Builds a list of children; theta.name is the list of their thetas.

    `devices[i]`, if given, is where child i's variables are created.
    Child i's path is `<path>.<name>[i]` and its checkpoint key
    `<name>_<i>`, unless `keys` names each child: then `<path>.<keys[i]>`
    and `keys[i]`, so inserting a child renames no other (a pipeline's
    layers are keyed by their names, as in Lingvo).
    """
    if keys is not None and len(keys) != len(params_list):
      raise LayerError(f'{self.path}: CreateChildren({name!r}) got '
                       f'{len(params_list)} params but {len(keys)} keys.')
    by_name = keys is not None
    keys = list(keys) if by_name else [
        f'{name}_{i}' for i in range(len(params_list))]
    self._CheckNewName(name, keys)
    if devices is not None and len(devices) != len(params_list):
      raise LayerError(
          f'{self.path}: CreateChildren({name!r}) got {len(params_list)} '
          f'params but {len(devices)} devices {list(devices)}; give one '
          'device (or None) per child.')
    children = []
    for i, params in enumerate(params_list):
      device = devices[i] if devices is not None else None
      with self._Building(keys[i] if by_name else f'{name}[{i}]'), (
          tf.device(device)):
        child = self._ChildParams(keys[i], params).Instantiate()
      self._track_trackable(child, name=keys[i])
      children.append(child)
    self._private_children[name] = children
    return children

  def CreateVariable(self, name: str, wp: Params) -> tf.Variable:
    """Creates variable `name` now, with a path-derived initial value;
    inside `sharing_variables(creator)`, the creator may hand back another
    layer's (a tied weight), which this layer uses but does not checkpoint.
    """
    self._CheckNewName(name)
    creator = getattr(_BUILD, 'creator', None)
    if creator is None:
      var, tracked = self._NewVariable(name, wp), True
    else:
      var, tracked = creator(self, name, wp,
                             lambda: self._NewVariable(name, wp))
    self._private_vars[name] = var
    if tracked:
      self._track_trackable(var, name=name)
    return var

  def _NewVariable(self, name: str, wp: Params) -> tf.Variable:
    dtype = wp.dtype or self._params.dtype
    init = wp.init or self._params.params_init
    shape = [int(d) for d in wp.shape]
    seed = stable_seed(self._random_seed, self.path, name)
    if init.method not in WeightInit.METHODS:
      raise LayerError(f'{self.path}.{name}: unknown WeightInit method '
                       f'{init.method!r}; use one of {WeightInit.METHODS}.')
    value = weight_init.initial_value(shape, init, dtype, seed)
    return tf.Variable(value, trainable=wp.trainable,
                       name=re.sub(r'[^\w./-]', '_', f'{self.path}/{name}'))

  def _CheckNewName(self, name: str,
                    checkpoint_names: Sequence[str] | None = None) -> None:
    """Raises LayerError unless `name` can key theta and the checkpoint."""
    if not name.isidentifier() or hasattr(NestedMap, name):
      raise LayerError(f'{self.path}: {name!r} cannot name a variable or '
                       'child: use an identifier that is not a NestedMap/dict '
                       'method (e.g. not "values", "items" or "copy").')
    taken = [n for n in [name] + list(checkpoint_names or [name])
             if n in self._private_vars or n in self._private_children or
             n in self._dependency_names]
    if taken:
      raise LayerError(f'{self.path}: {taken[0]!r} is already a variable or '
                       'child of this layer; pick another name.')
    self._dependency_names.update(checkpoint_names or [name])

  # ---- Computing -------------------------------------------------------------
  def FProp(self, theta: NestedMap, *inputs: Any) -> Any:
    """Computes outputs from theta and inputs only. Subclasses override."""
    raise NotImplementedError(f'{type(self).__name__} must implement FProp.')

  def __call__(self, *inputs: Any) -> Any:
    return self.FProp(self.theta, *inputs)

  @classmethod
  def FPropMeta(cls, p: Params, *input_shapes: Any) -> LayerMeta:
    """Cost and output shapes of FProp on inputs of these shapes."""
    raise NotImplementedError(
        f'{cls.__name__} must implement FPropMeta(p, *input_shapes) so that '
        'the partitioner can cost it.')

  # ---- Statistics (BatchNorm and friends) -----------------------------------
  def FoldStats(self, stats: NestedMap) -> list[tf.Operation]:
    """Folds summed statistics of one step into this layer's state."""
    raise NotImplementedError(f'{self.path} collected statistics but '
                              f'{type(self).__name__} does not fold them.')

  def UpdateStats(self, stats: dict[str, NestedMap]) -> None:
    """Applies `stats` (keyed by layer path) to the layers of this subtree."""
    known = {layer.path: layer for layer in self.Walk()}
    for path, s in stats.items():
      if path not in known:
        raise LayerError(f'Statistics for {path!r}, which is not a layer '
                         f'under {self.path!r}.')
      known[path].FoldStats(s)

  def AddStats(self, stats: NestedMap) -> None:
    """Called from FProp: adds this call's sufficient statistics, if
    the current context collects them (training forward, not recompute)."""
    collector = fprop_context.current().stats
    if collector is not None:
      collector.add(self.path, stats)
