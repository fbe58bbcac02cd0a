"""Pipelining a Keras model: its layers in as Params, trained weights back out.

torchgpipe takes an `nn.Sequential` as it is; this module does the same
for a Keras 3 `Sequential` (or a Functional model that is a chain):

    model = keras.Sequential([keras.Input((28, 28, 1)), ...])
    p = gpipe.PipeliningLayer.Params().Set(
        name='net', layers=lp_keras.from_keras(model), num_stages=2,
        num_micro_batches=4, input_shapes=[[64, 28, 28, 1]])
    net = p.Instantiate()          # the model's weights, cut into 2 stages
    ...                            # train: net.FPropLoss, or a PipelinedTask
    lp_keras.to_keras(net, model)  # then model.evaluate, model.save, serving

Each Keras layer becomes one `KerasLayer` (layers/keras_layer.py): its
config and build shapes are Params (params.txt shows them), its weights
come along by name (`keras_weights`, see `register_weights`), and a layer
that the pipeline could not train as Keras would (one that updates state in
training, other than BatchNormalization, or adds losses) is refused here,
naming it. The Keras dtype policy maps onto dtype and fprop_dtype:
`mixed_bfloat16` is float32 weights computing in bfloat16.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import keras
import numpy as np

from lingvo_pipe.core import base_layer
from lingvo_pipe.core import params_text
from lingvo_pipe.core.hyperparams import InstantiableParams
from lingvo_pipe.layers import keras_build
from lingvo_pipe.layers import keras_layer as keras_layer_lib
from lingvo_pipe.layers.keras_layer import KerasLayer

__all__ = ['KerasLayer', 'from_keras', 'layer_params', 'to_keras']

LayerError = base_layer.LayerError


def from_keras(model: Any, input_shape: Sequence[Any] | None = None,
               weights: bool = True) -> list[InstantiableParams]:
  """The Params of `model`'s layers, in order, for a PipeliningLayer.

  Args:
    model: a keras.Sequential, a Functional model whose layers form a
      chain (each takes the previous one's output), or one layer; nested
      chains are flattened.
    input_shape: the model's input shape, batch first, if the model has no
      `keras.Input` (it is then built for it, as a first call would).
    weights: True: the layers' current weights come along (registered in
      this process under the hash of their values). False: lingvo_pipe
      draws them from the layers' initializers, seeded by layer path — what
      a registered config wants, whose every process must agree.

  Raises:
    LayerError: naming the layer, for a model that is not a chain, a layer
      Keras cannot rebuild from its config, or one the pipeline would not
      train faithfully.
  """
  shape = _input_shape(model, input_shape)
  out, names = [], set()
  for layer in _chain(model):
    p = layer_params(layer, shape, weights)
    if p.name in names:
      raise LayerError(f'{model.name}: two layers are named {p.name!r}; '
                       'pipelined layers are keyed by name: rename one.')
    names.add(p.name)
    out.append(p)
    spec = layer.compute_output_spec(keras.KerasTensor(shape))
    shape = tuple(spec.shape)
  return out


def layer_params(layer: Any, input_shape: Sequence[Any] | None = None,
                 weights: bool = True) -> InstantiableParams:
  """The KerasLayer Params of one Keras layer (see `from_keras`)."""
  where = f'Keras layer {layer.name!r} ({type(layer).__name__})'
  config = keras.saving.serialize_keras_object(layer)
  build_config = config.pop('build_config', None)
  if build_config is None and input_shape is not None:
    build_config = {'input_shape': tuple(input_shape)}
  config['config'] = {k: v for k, v in config['config'].items()
                      if k != 'dtype'}  # dtype and fprop_dtype say it.
  dtype, fprop_dtype = keras_build.policy_dtypes(layer, where)
  p = KerasLayer.Params().Set(
      name=_identifier(layer.name), keras_layer=_plain(config, where),
      build_config=_plain(build_config, where), dtype=dtype,
      fprop_dtype=fprop_dtype)
  keras_layer_lib.prototype(p, 'from_keras')  # Refuses it now, naming it.
  if weights and layer.weights:
    p.keras_weights = keras_layer_lib.register_weights(
        [np.asarray(w.value) for w in layer.weights])
  return p


def to_keras(layer: base_layer.BaseLayer, model: Any = None) -> Any:
  """Writes the weights of `layer`'s KerasLayers into a Keras model.

  Args:
    layer: a PipeliningLayer, a task or any layer holding KerasLayers (all
      of them in this process: after a multi-process run, restore the
      checkpoint in one process, as the evaler does).
    model: the Keras model they came from (its layers are matched by
      name); None builds a keras.Sequential of them.

  Returns:
    The model, ready for `model.evaluate`, `model.save` or export.

  Raises:
    LayerError: a layer of the model with weights has no KerasLayer, or
      their shapes differ.
  """
  found = {}
  for sub in layer.Walk():
    if type(sub).__name__ == '_RemoteLayer':
      raise LayerError(f'{sub.path} runs in another stage process; to_keras '
                       'needs every layer: restore the checkpoint in one '
                       'process (build the task there) and call it again.')
    if isinstance(sub, KerasLayer):
      found[sub.keras_layer.name] = sub
  if model is None:
    model = _sequential(list(found.values()))
  for target in _chain(model):
    source = found.get(target.name)
    if source is None:
      if target.weights:
        raise LayerError(f'{model.name}: layer {target.name!r} has weights '
                         f'but {layer.path} holds no KerasLayer of that name.')
      continue
    values = [source.theta[k] for k in source.weight_keys]
    if [tuple(v.shape) for v in values] != [tuple(w.shape)
                                           for w in target.weights]:
      raise LayerError(f'{source.path}: its weights do not fit Keras layer '
                       f'{target.name!r} of {model.name} (other shapes).')
    for w, v in zip(target.weights, values):
      w.assign(v)
  return model


def _sequential(layers: list[KerasLayer]) -> Any:
  """A keras.Sequential of fresh Keras layers with the KerasLayers' configs."""
  if not layers:
    raise LayerError('to_keras found no KerasLayer to build a model of.')
  first = keras_build.input_shapes(layers[0].params.build_config)
  if not first or len(first) != 1 or keras_build.is_shape_list(first[0]):
    raise LayerError(f'{layers[0].path}: to_keras builds a Sequential of '
                     'one input; pass the Keras model to fill instead.')
  fresh = [keras.Input(tuple(first[0])[1:])]
  for sub in layers:
    p = sub.params
    config = dict(p.keras_layer)
    config['config'] = dict(config['config'], dtype=keras_build.policy_name(
        p.dtype, p.fprop_dtype))
    fresh.append(keras.saving.deserialize_keras_object(config))
  return keras.Sequential(fresh)


def _input_shape(model: Any, input_shape: Sequence[Any] | None) -> tuple:
  inputs = getattr(model, 'inputs', None)
  if input_shape is not None:
    if not getattr(model, 'built', True) and isinstance(model, keras.Model):
      model.build(tuple(input_shape))
    return tuple(input_shape)
  if inputs:
    if len(inputs) != 1:
      raise LayerError(f'{model.name}: {len(inputs)} inputs; from_keras '
                       'pipelines a chain with one input.')
    return tuple(inputs[0].shape)
  build = model.get_build_config() or {}
  if 'input_shape' in build:
    return tuple(build['input_shape'])
  raise LayerError(f'{model.name} has no input shape yet; give it a '
                   'keras.Input, or call from_keras(model, input_shape=(None, '
                   '...)).')


def _chain(model: Any) -> list[Any]:
  """The layers of a chain model in order, nested chains flattened."""
  if isinstance(model, keras.Sequential):
    layers = list(model.layers)
  elif isinstance(model, keras.Model):
    layers = _functional_chain(model)
  else:
    return [model]
  out = []
  for layer in layers:
    out += _chain(layer) if isinstance(layer, keras.Model) else [layer]
  return out


def _functional_chain(model: Any) -> list[Any]:
  """A Functional model's layers, if each takes the previous one's output."""
  config = model.get_config()
  inputs = config['input_layers']
  inputs = [inputs] if isinstance(inputs[0], str) else inputs
  if len(inputs) != 1:
    raise LayerError(f'{model.name}: {len(inputs)} inputs; from_keras '
                     'pipelines a chain with one input.')
  previous, names = inputs[0][0], []
  for entry in config['layers']:
    if entry['class_name'] == 'InputLayer':
      continue
    nodes = entry.get('inbound_nodes') or []
    sources = _sources(nodes[0].get('args', [])) if len(nodes) == 1 else []
    if sources != [previous] or nodes[0].get('kwargs'):
      raise LayerError(
          f'{model.name}: layer {entry["name"]!r} takes {sources or "no"} '
          f'(called {len(nodes)} times) where a chain takes {previous!r} '
          'once; from_keras pipelines a chain: wrap branches in a keras.Layer '
          'subclass of your own.')
    previous = entry['name']
    names.append(previous)
  outputs = config['output_layers']
  outputs = [outputs] if isinstance(outputs[0], str) else outputs
  if [o[0] for o in outputs] != [previous]:
    raise LayerError(f'{model.name}: its outputs {outputs} are not the last '
                     f'layer {previous!r} of the chain.')
  return [model.get_layer(name) for name in names]


def _sources(args: Any) -> list[str]:
  """Names of the layers whose outputs a serialized call's args hold."""
  if isinstance(args, dict):
    if args.get('class_name') == '__keras_tensor__':
      return [args['config']['keras_history'][0]]
    return [s for v in args.values() for s in _sources(v)]
  if isinstance(args, (list, tuple)):
    return [s for v in args for s in _sources(v)]
  return []


def _identifier(name: str) -> str:
  name = re.sub(r'\W', '_', name)
  return name if name.isidentifier() else f'layer_{name}'


def _plain(value: Any, where: str) -> Any:
  """`value` with numpy values as Python ones, checked to print as text."""
  def convert(v: Any) -> Any:
    if isinstance(v, dict):
      return {k: convert(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
      return type(v)(convert(x) for x in v)
    if isinstance(v, np.ndarray):
      return convert(v.tolist())
    if isinstance(v, np.generic):
      return v.item()
    return v

  plain = convert(value)
  try:
    params_text.value_to_text(where, plain)
  except params_text.ParamsError as e:
    raise LayerError(f'{where}: its config cannot be written as params '
                     f'text ({e}).') from None
  return plain
