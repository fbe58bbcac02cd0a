"""Optimizers whose slots live on their variable's device.

Pipeline stages put their weights on different devices (later, on different
worker processes). An optimizer slot belongs with its weight: the update then
runs where the weight is, nothing crosses a device boundary but the
gradient, and GPipe's memory accounting (RMSProp: weight + 2 slots = 12 bytes
per float32 parameter *on that stage*) holds. So every slot is created, and
every update runs, under `tf.device(var.device)`.

Slots are tracked by the name of their variable (`optimizer/_slots/<var
name>/<slot>` in a checkpoint), not by position, so a checkpoint restores
correctly whatever order the variables are listed in.

The update rules, for gradient g and learning rate lr (`task.train` keys in
brackets):

    sgd      mom = momentum·mom + g;  var −= lr·mom                   [momentum]
    adam     m = β1·m + (1−β1)·g;  v = β2·v + (1−β2)·g²;  t = step + 1
             var −= lr·sqrt(1−β2^t)/(1−β1^t) · m / (sqrt(v) + ε)
    rmsprop  ms = decay·ms + (1−decay)·g²                 [rmsprop_decay]
             mom = momentum·mom + lr·g / sqrt(ms + ε);  var −= mom

sgd and rmsprop are TF1's MomentumOptimizer and RMSPropOptimizer (which
Lingvo and the GPipe AmoebaNet recipe use), including RMSProp's `ms` slot
starting at 1.0, not 0: with 0 the first steps would move every weight by
about lr/sqrt(1−decay) regardless of its gradient's size. Adam is TF1's
AdamOptimizer (ε added to sqrt(v), bias correction folded into the rate).

Why not Keras 3's optimizers: they do colocate slots with variables, but they
checkpoint slots by position (`_variables/7`), so a model whose variables are
listed in another order (another partition) restores the wrong slots
silently; they keep their own iteration counter and learning-rate variable
beside the trainer's global step; and their RMSProp starts `ms` at 0.
"""

from __future__ import annotations

import re
from typing import Sequence

import tensorflow as tf

from lingvo_pipe import errors
from lingvo_pipe.core.hyperparams import Params

OPTIMIZERS = ('sgd', 'adam', 'rmsprop')


class OptimizerError(errors.LingvoPipeError):
  """Bad optimizer params or variables; the message names the param."""


def slot_key(var: tf.Variable) -> str:
  """The name a variable's slots are kept (and checkpointed) under."""
  return re.sub(r':\d+$', '', var.name)


class BaseOptimizer(tf.Module):
  """Slots per variable, created on the variable's device by `build`.

  Subclasses list their slots (name → initial value) in `SLOTS` and implement
  `_apply_one`. Usage:

      opt = optimizer.from_params(task.params.train)
      opt.build(task.trainable_variables)       # before restoring a checkpoint
      opt.apply(grads, task.trainable_variables, lr, step)
  """

  SLOTS: dict[str, float] = {}

  def __init__(self, train: Params) -> None:
    super().__init__(name=type(self).__name__.lower())
    self._train = train
    self._slots: dict[str, dict[str, tf.Variable]] = {}
    # Which variable owns each slot key; a plain dict, not checkpointed.
    object.__setattr__(self, '_owners', {})
    object.__setattr__(self, '_copy_slots', {})  # Not checkpointed either.

  def build(self, variables: Sequence[tf.Variable],
            untracked: Sequence[tf.Variable] = ()) -> None:
    """Creates the slots of `variables` (each on its variable's device).

    The slots of `untracked` ones (among `variables`: copies of a tied
    weight that another process owns, `tied_weights`) are kept out of
    checkpoints: the owner's slots are saved instead.

    Raises:
      OptimizerError: two variables share a name (their slots would clash).
    """
    slots = dict(self._slots)
    copies = {v.ref() for v in untracked}
    for var in variables:
      key = slot_key(var)
      owner = self._owners.setdefault(key, var.ref())
      if owner != var.ref():
        raise OptimizerError(
            f'Two variables are named {key!r}; slots are keyed by variable '
            'name, so give every variable a unique name (layers do: their '
            'path).')
      if key in slots or key in self._copy_slots:
        continue
      with tf.device(var.device):
        made = {
            name: tf.Variable(tf.fill(var.shape, tf.cast(init, var.dtype)),
                              trainable=False, name=f'{key}/{name}')
            for name, init in self.SLOTS.items()
        }
      (self._copy_slots if var.ref() in copies else slots)[key] = made
    self._slots = slots  # Reassigned so tf.Module tracks the new entries.

  def slots(self, var: tf.Variable) -> dict[str, tf.Variable]:
    """The slot variables of `var`, by slot name."""
    key = slot_key(var)
    if key in self._copy_slots:
      return self._copy_slots[key]
    if key not in self._slots:
      raise OptimizerError(
          f'No slots for variable {key!r}: call build(variables) with every '
          'variable before apply().')
    return self._slots[key]

  def apply(self, grads: Sequence[tf.Tensor], variables: Sequence[tf.Variable],
            learning_rate: tf.Tensor, step: tf.Tensor) -> None:
    """Applies one update; each variable's update runs on its device.

    Args:
      grads: One gradient per variable; None entries are skipped.
      variables: The variables to update.
      learning_rate: Float scalar.
      step: Updates applied before this one (int scalar).
    """
    if len(grads) != len(variables):
      raise OptimizerError(f'{len(grads)} gradients for {len(variables)} '
                           'variables.')
    for grad, var in zip(grads, variables):
      if grad is None:
        continue
      with tf.device(var.device):
        lr = tf.cast(learning_rate, var.dtype)
        self._apply_one(tf.cast(grad, var.dtype), var, self.slots(var), lr,
                        step)

  def _apply_one(self, g: tf.Tensor, var: tf.Variable,
                 slots: dict[str, tf.Variable], lr: tf.Tensor,
                 step: tf.Tensor) -> None:
    raise NotImplementedError


class SgdMomentum(BaseOptimizer):
  """TF1 MomentumOptimizer: mom = momentum·mom + g; var −= lr·mom."""

  SLOTS = {'momentum': 0.0}

  def _apply_one(self, g, var, slots, lr, step):
    mom = slots['momentum']
    mom.assign(self._train.momentum * mom + g)
    var.assign_sub(lr * mom)


class Adam(BaseOptimizer):
  """TF1 AdamOptimizer (see the module docstring for the update)."""

  SLOTS = {'m': 0.0, 'v': 0.0}

  def _apply_one(self, g, var, slots, lr, step):
    b1, b2, eps = (self._train.adam_beta1, self._train.adam_beta2,
                   self._train.epsilon)
    t = tf.cast(step, var.dtype) + 1.0
    lr_t = lr * tf.sqrt(1.0 - tf.pow(b2, t)) / (1.0 - tf.pow(b1, t))
    m, v = slots['m'], slots['v']
    m.assign(b1 * m + (1.0 - b1) * g)
    v.assign(b2 * v + (1.0 - b2) * tf.square(g))
    var.assign_sub(lr_t * m / (tf.sqrt(v) + eps))


class RmsProp(BaseOptimizer):
  """TF1 RMSPropOptimizer with momentum; `ms` starts at 1.0."""

  SLOTS = {'ms': 1.0, 'momentum': 0.0}

  def _apply_one(self, g, var, slots, lr, step):
    decay, eps = self._train.rmsprop_decay, self._train.epsilon
    ms, mom = slots['ms'], slots['momentum']
    ms.assign(decay * ms + (1.0 - decay) * tf.square(g))
    mom.assign(self._train.momentum * mom + lr * g / tf.sqrt(ms + eps))
    var.assign_sub(mom)


_CLASSES = {'sgd': SgdMomentum, 'adam': Adam, 'rmsprop': RmsProp}


def validate(train: Params) -> None:
  """Checks `task.train.optimizer` and its constants; raises OptimizerError."""
  if train.optimizer not in _CLASSES:
    raise OptimizerError(f'task.train.optimizer is {train.optimizer!r}; use '
                         f'one of {", ".join(OPTIMIZERS)}.')
  for key in ('momentum', 'rmsprop_decay', 'adam_beta1', 'adam_beta2'):
    value = getattr(train, key)
    if not 0.0 <= value < 1.0:
      raise OptimizerError(f'task.train.{key} must be in [0, 1), got '
                           f'{value}.')
  if train.epsilon < 0:
    raise OptimizerError(f'task.train.epsilon must be ≥ 0, got '
                         f'{train.epsilon}.')


def from_params(train: Params) -> BaseOptimizer:
  """The optimizer named by `task.train.optimizer`, configured by `train`."""
  validate(train)
  return _CLASSES[train.optimizer](train)
