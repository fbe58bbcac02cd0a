"""Greedy and beam-search decoding of the pipelined translator.

Training runs the layer list as a pipeline on whole target sequences.
Decoding cannot: token t+1 depends on token t, so the decoder layers run one
position at a time with their `ExtendStep` caches (O(T_max) per token, not
O(t²)). `PipelineDecoder` therefore walks the same layers outside the
pipeline, each under its stage's device (that is where its variables live):

    memory = encode(src)                         # embedding, encoder, once
    state  = per decoder layer: self-attention cache [B, T_max, N, H]
    for t in 0..T_max-1:                         # one tf.while_loop
      log_probs, state = step(prev_ids, t, state)
      prev_ids = pick(log_probs)                 # argmax, or beam pruning

The searches only see `step_fn(ids_t [B], t, state) -> (log_probs [B, V],
state)`, so they are tested on tiny hand-made distributions too.

Beam search (fairseq's rule, GNMT's length penalty): each step takes the 2K
best extensions of the K alive beams; an EOS among the K best of them ends a
hypothesis, scored log P / lp(length) with lp(n) = ((5 + n) / 6)^α; the K
best non-EOS extensions stay alive. A sentence is done when no alive beam can
still beat its best finished one (log P only falls, lp only grows, so the
bound is alive log P / lp(T_max)). With K = 1 and α = 0 this is exactly
greedy search. Every shape is static, so the loop traces once.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from lingvo_pipe import errors
from lingvo_pipe.core.nested_map import NestedMap
from lingvo_pipe.tasks.mt import layers as mt_layers
from lingvo_pipe.tasks.mt import vocab

StepFn = Callable[[tf.Tensor, tf.Tensor, Any], tuple[tf.Tensor, Any]]
_NEG = -1.0e9  # Finite "minus infinity": keeps arithmetic free of NaN.


class DecodeError(errors.LingvoPipeError):
  """A layer list or search setting that cannot be decoded."""


class PipelineDecoder:
  """Runs a PipeliningLayer of `lingvo_pipe.tasks.mt.layers` token by token.

  In a TranslationTask (`task`, its `theta`; see tasks/mt/model.py):

      dec = PipelineDecoder(task.children.pipeline)
      memory = dec.encode(theta.pipeline, src_ids, src_paddings)
      step_fn, state = dec.step_fn(theta.pipeline, memory, src_paddings, 64)
      ids = greedy_search(step_fn, state, batch_size, 64)
  """

  def __init__(self, pipeline: Any) -> None:
    # The classes from the params: a stage process builds only its own
    # stage's layers (the others stand in), and decodes nothing.
    kinds = [lp.cls for lp in pipeline.params.layers]
    where = pipeline.path
    if not (issubclass(kinds[0], mt_layers.SourceTargetEmbedding) and
            issubclass(kinds[-1], mt_layers.DecoderSoftmax)):
      raise DecodeError(
          f'{where}: decoding needs layers[0] to be a SourceTargetEmbedding '
          f'and the last a DecoderSoftmax, got {kinds[0].__name__} '
          f'and {kinds[-1].__name__}; build the list with '
          'lingvo_pipe.tasks.mt.model.transformer_layers.')
    self._pipeline = pipeline
    self._layers = list(pipeline.children.layers)
    self._encoders = [i for i, c in enumerate(kinds)
                      if issubclass(c, (mt_layers.EncoderLayer,
                                        mt_layers.EncoderFinalNorm))]
    self._decoders = [i for i, c in enumerate(kinds)
                      if issubclass(c, mt_layers.DecoderLayer)]
    if not self._decoders or (self._encoders and
                              max(self._encoders) > min(self._decoders)):
      raise DecodeError(f'{where}: expected encoder layers, then at least '
                        'one DecoderLayer; build the list with '
                        'lingvo_pipe.tasks.mt.model.transformer_layers.')
    bounds, devices = pipeline.boundaries, pipeline.devices
    self._device = [devices[k] for k in range(len(devices))
                    for _ in range(bounds[k], bounds[k + 1])]

  def _thetas(self, theta: NestedMap) -> list[NestedMap]:
    """Each layer's theta (tied weights as the layer reads them)."""
    placement = self._pipeline.placement
    if placement.multi_process:
      raise DecodeError(
          f'{self._pipeline.path}: this stage process holds only stage '
          f'{placement.device} of {placement.num_devices}, and decoding '
          'runs every layer; decode in one process: the evaler reads the '
          'stage processes\' checkpoints (python -m lingvo_pipe.evaler '
          '--model=... --logdir=<this run\'s logdir>).')
    return self._pipeline.LayerThetas(theta)

  def encode(self, theta: NestedMap, src_ids: tf.Tensor,
             src_paddings: tf.Tensor) -> tf.Tensor:
    """Source ids [B, S] → memory [B, S, D], layer by layer on its device."""
    thetas = self._thetas(theta)
    with tf.device(self._device[0]):
      x = self._layers[0].EmbedSource(thetas[0], src_ids)
    paddings = tf.cast(src_paddings, x.dtype)
    for i in self._encoders:
      with tf.device(self._device[i]):
        x = self._layers[i].Encode(thetas[i], x, paddings)
    return x

  def step_fn(self, theta: NestedMap, memory: tf.Tensor,
              memory_paddings: tf.Tensor,
              max_len: int) -> tuple[StepFn, list[NestedMap]]:
    """The search's step function and its initial state.

    Args:
      theta: the pipeline's theta.
      memory: [B', S, D] encoder output (B' = B·K rows for beam search).
      memory_paddings: [B', S].
      max_len: T_max, the longest output (cache length).

    Returns:
      (step_fn, state): state is each decoder layer's self-attention cache;
      the projected memory is closed over (beams never need to reorder it:
      all beams of a sentence share it).
    """
    memory_paddings = tf.cast(memory_paddings, memory.dtype)
    thetas = self._thetas(theta)
    static, state = [], []
    for i in self._decoders:
      with tf.device(self._device[i]):
        cache = self._layers[i].InitDecodeCache(thetas[i], memory, max_len)
      static.append(cache.memory)
      state.append(cache.self_atten)

    def step(ids_t: tf.Tensor, t: tf.Tensor,
             state: list[NestedMap]) -> tuple[tf.Tensor, list[NestedMap]]:
      with tf.device(self._device[0]):
        x = self._layers[0].EmbedTarget(thetas[0], ids_t[:, None], t)
      new_state = []
      for j, i in enumerate(self._decoders):
        with tf.device(self._device[i]):
          cache = NestedMap(self_atten=state[j], memory=static[j])
          x, cache = self._layers[i].ExtendStep(thetas[i], x,
                                                memory_paddings, cache, t)
        new_state.append(cache.self_atten)
      with tf.device(self._device[-1]):
        logits = self._layers[-1].Logits(thetas[-1], x)[:, 0]
        log_probs = tf.nn.log_softmax(tf.cast(logits, tf.float32))
      return log_probs, new_state

    return step, state


def greedy_search(step_fn: StepFn, state: Any, batch_size: Any, max_len: int,
                  bos_id: int = vocab.BOS_ID, eos_id: int = vocab.EOS_ID,
                  pad_id: int = vocab.PAD_ID) -> tf.Tensor:
  """The most likely token at every step, until EOS or max_len.

  Returns:
    int32 [B, max_len]: ids up to and including EOS, then pad_id.
  """
  at = tf.range(max_len)[None, :]  # [1, T]

  def body(t, prev, done, ids, state):
    log_probs, state = step_fn(prev, t, state)
    tok = tf.argmax(log_probs, axis=-1, output_type=tf.int32)
    tok = tf.where(done, pad_id, tok)
    ids = tf.where(at == t, tok[:, None], ids)
    return t + 1, tok, done | tf.equal(tok, eos_id), ids, state

  def cond(t, prev, done, ids, state):
    del prev, ids, state
    return tf.logical_and(t < max_len, tf.logical_not(tf.reduce_all(done)))

  loop_vars = (tf.constant(0), tf.fill([batch_size], bos_id),
               tf.zeros([batch_size], tf.bool),
               tf.fill([batch_size, max_len], pad_id), state)
  return tf.while_loop(cond, body, loop_vars)[3]


def gnmt_length_penalty(length: Any, alpha: float) -> tf.Tensor:
  """GNMT's lp(n) = ((5 + n) / 6)^α (1 for α = 0)."""
  return tf.pow((5.0 + tf.cast(length, tf.float32)) / 6.0, alpha)


def beam_search(step_fn: StepFn, state: Any, batch_size: Any, beam_size: int,
                max_len: int, length_penalty: float = 0.0,
                bos_id: int = vocab.BOS_ID, eos_id: int = vocab.EOS_ID,
                pad_id: int = vocab.PAD_ID) -> NestedMap:
  """Beam search (see the module docstring).

  Args:
    step_fn: `(ids [B·K], t, state) -> (log_probs [B·K, V], state)`; row
      b·K + k is beam k of sentence b.
    state: nest of [B·K, ...] tensors (e.g. caches), reordered with beams.
    batch_size: B.
    beam_size: K ≥ 1; V must be ≥ 2K.
    max_len: T_max.
    length_penalty: α ≥ 0 of lp(n) = ((5 + n) / 6)^α.
    bos_id, eos_id, pad_id: special ids.

  Returns:
    NestedMap(ids [B, T_max] best hypothesis (EOS then pad_id), scores [B]
    its log P / lp(length), beam_ids [B, K, T_max] and beam_scores [B, K]
    of the finished hypotheses (score −1e9 where fewer than K finished)).
  """
  k, big = beam_size, 2 * beam_size
  if not isinstance(k, int) or k < 1 or length_penalty < 0:
    raise DecodeError(f'beam_size must be an int ≥ 1 and length_penalty '
                      f'≥ 0, got {beam_size!r} and {length_penalty}.')
  at = tf.range(max_len)[None, None, :]  # [1, 1, T]
  rows = tf.range(batch_size)[:, None] * k  # [B, 1]
  final_lp = gnmt_length_penalty(max_len, length_penalty)

  def body(t, prev, alive_seq, alive_logp, fin_seq, fin_score, state):
    log_probs, state = step_fn(prev, t, state)  # [B·K, V]
    v = tf.shape(log_probs)[-1]
    scores = alive_logp[:, :, None] + tf.reshape(log_probs,
                                                 [batch_size, k, v])
    top, idx = tf.math.top_k(tf.reshape(scores, [batch_size, k * v]), big)
    parent, tok = idx // v, idx % v  # [B, 2K]
    seqs = tf.gather(alive_seq, parent, batch_dims=1)  # [B, 2K, T]
    seqs = tf.where(at == t, tok[:, :, None], seqs)
    is_eos = tf.equal(tok, eos_id)
    # Alive: the K best extensions that are not EOS.
    alive_logp, pick = tf.math.top_k(tf.where(is_eos, _NEG, top), k)
    alive_seq = tf.gather(seqs, pick, batch_dims=1)
    prev = tf.reshape(tf.gather(tok, pick, batch_dims=1), [-1])
    order = tf.reshape(tf.gather(parent, pick, batch_dims=1) + rows, [-1])
    state = tf.nest.map_structure(lambda s: tf.gather(s, order), state)
    # Finished: EOS among the K best extensions, by length-penalised score.
    in_top_k = tf.range(big)[None, :] < k
    ended = tf.where(is_eos & in_top_k,
                     top / gnmt_length_penalty(t + 1, length_penalty), _NEG)
    fin_score, pick = tf.math.top_k(tf.concat([fin_score, ended], 1), k)
    fin_seq = tf.gather(tf.concat([fin_seq, seqs], 1), pick, batch_dims=1)
    return t + 1, prev, alive_seq, alive_logp, fin_seq, fin_score, state

  def cond(t, prev, alive_seq, alive_logp, fin_seq, fin_score, state):
    del prev, alive_seq, fin_seq, state
    done = fin_score[:, 0] >= alive_logp[:, 0] / final_lp
    return tf.logical_and(t < max_len, tf.logical_not(tf.reduce_all(done)))

  first = tf.concat([tf.zeros([1]), tf.fill([k - 1], _NEG)], 0)
  loop_vars = (tf.constant(0), tf.fill([batch_size * k], bos_id),
               tf.fill([batch_size, k, max_len], pad_id),
               tf.tile(first[None], [batch_size, 1]),
               tf.fill([batch_size, k, max_len], pad_id),
               tf.fill([batch_size, k], _NEG), state)
  out = tf.while_loop(cond, body, loop_vars)
  _, _, alive_seq, alive_logp, fin_seq, fin_score, _ = out
  has_finished = fin_score[:, 0] > _NEG / 2  # Else: best truncated beam.
  return NestedMap(
      ids=tf.where(has_finished[:, None], fin_seq[:, 0], alive_seq[:, 0]),
      scores=tf.where(has_finished, fin_score[:, 0],
                      alive_logp[:, 0] / final_lp),
      beam_ids=fin_seq, beam_scores=fin_score)
