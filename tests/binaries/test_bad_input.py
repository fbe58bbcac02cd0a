"""Bad input ends with one clear line on stderr, exit 2, logdir untouched.

Guards issue 11: of 103 bad inputs probed from the outside, 28 gave a
traceback and 14 wrote into the logdir (micro-batch and partition errors,
non-UTF-8 params, damaged checkpoints, parser gaps, unwritable paths), and a
garbage `checkpoint` file silently restarted training from step 0.
"""

import os
import shutil

import pytest

import binary_runner as br
from lingvo_pipe.core import model_registry

_TYPO = 'synthetic.regresion.MlpRegression'
_PIPE = '--model_params_override=task.pipeline.'
# A trained logdir (conftest: 30 steps, a checkpoint every 10) continued.
_MORE = (f'--model={br.MODEL}', '--max_steps=40',
         f'--model_params_override={br.FAST}; '
         'task.train.save_interval_steps: 10')


def _train(logdir_field, *extra):
  return ['--logdir={%s}' % logdir_field, *_MORE, *extra]


def _new(*extra):
  return [f'--model={br.MODEL}', '--logdir={fresh}', *extra]


# The synthetic model with 5 outputs instead of 4: other shapes.
_RESIZED = 'task.pipeline.layers[4].output_dim: 5; input.output_dim: 5'


def _resume(logdir_field, override):
  """The trained run continued with `override` (no other override flag)."""
  return ['--logdir={%s}' % logdir_field, *_MORE[:2],
          f'{_MORE[2]}; {override}']


# (case, binary, args, what the one line must contain: a string, or a tuple
# of alternatives). Fields: {fresh} a path that does not exist; {eval} a
# logdir holding only a params.txt; {file} a regular file; {bad_utf8} a
# params file with a byte that is not UTF-8; {bad_seed} a params file
# setting `task.random_seed : abc`; the others are copies of a trained
# logdir, damaged as `_DAMAGE` says.
_CASES = [
    ('unknown_model', 'trainer', [f'--model={_TYPO}', '--logdir={fresh}'],
     f'Closest: {br.MODEL}'),
    ('malformed_override', 'trainer',
     _new('--model_params_override=task.train.learning_rate 0.1'),
     'Malformed params line'),
    ('undefined_param', 'trainer',
     _new('--model_params_override=task.train.learning_rat: 0.1'),
     "Did you mean 'learning_rate'"),
    ('missing_override_file', 'trainer',
     _new('--model_params_file_override={fresh}.txt'),
     'Cannot read --model_params_file_override'),
    ('logdir_not_writable', 'trainer',
     [f'--model={br.MODEL}', '--logdir={file}/logdir'], 'is not writable'),
    ('negative_minutes', 'trainer', _new('--max_train_minutes=-1'),
     '--max_train_minutes=-1 is negative'),
    ('negative_slice', 'trainer', _new('--compute_slice_us=-1'),
     'flag --compute_slice_us=-1'),
    ('negative_threads', 'trainer', _new('--inter_op_threads=-1'),
     'flag --inter_op_threads=-1'),
    ('profile_steps_backwards', 'trainer', _new('--profile_steps=12,10'),
     '--profile_steps=12,10: give the first and last step to trace'),
    ('malformed_flag', 'trainer', _new('--max_steps=ten'),
     "flag --max_steps=ten: invalid literal"),
    ('unknown_flag', 'trainer', _new('--max_step=10'),
     "Unknown command line flag 'max_step'"),
    ('no_data', 'trainer',
     _new('--model_params_override=input.npz_path: /no/such/data.npz'),
     'data not available'),
    # ---- Pipeline params: refused before anything is written.
    ('pipeline_split_outside', 'trainer', _new(_PIPE + 'split_points: [100]'),
     'split_points[0] = 100 is outside (0, 5)'),
    ('pipeline_split_decreasing', 'trainer',
     _new(_PIPE + 'num_stages: 3; task.pipeline.split_points: [3, 1]'),
     'strictly increasing'),
    ('pipeline_more_stages_than_layers', 'trainer',
     _new(_PIPE + 'num_stages: 10'), 'num_stages=10 but there are 5 layers'),
    ('pipeline_more_stages_than_devices', 'trainer',
     _new(_PIPE + 'num_stages: 4'), '4 stages need 4 devices'),
    ('pipeline_unknown_device', 'trainer',
     _new(_PIPE + 'devices: ["/device:CPU:7", "/device:CPU:1"]'),
     "devices[0]='/device:CPU:7' does not exist"),
    ('pipeline_m_not_a_divisor', 'trainer',
     _new(_PIPE + 'num_micro_batches: 5'),
     'batch size 32 is not divisible by num_micro_batches=5'),
    ('pipeline_m_exceeds_batch', 'trainer',
     _new(_PIPE + 'num_micro_batches: 64'),
     'num_micro_batches=64 exceeds the batch size 32'),
    ('pipeline_micro_batch_size', 'trainer',
     _new(_PIPE + 'micro_batch_size: 5'),
     'not a multiple of micro_batch_size=5'),
    ('pipeline_m_and_micro_batch_size', 'trainer',
     _new(_PIPE + 'micro_batch_size: 8; task.pipeline.num_micro_batches: 2'),
     'set only one'),
    ('pipeline_batch_size_vs_m', 'trainer',
     _new('--model_params_override=input.batch_size: 30'),
     'batch size 30 is not divisible by num_micro_batches=4'),
    ('pipeline_data_vs_input_shapes', 'trainer',
     _new('--model_params_override=input.input_dim: 17'),
     'task.pipeline.input_shapes = [[32, 16]]'),
    ('pipeline_input_shapes_vs_layers', 'trainer',
     _new(_PIPE + 'input_shapes: [[32, 17]]'),
     "rejects its input shapes ['(32, 17)']"),
    ('pipeline_batch_dim', 'trainer', _new(_PIPE + 'batch_dim: 1'),
     'task.pipeline.batch_dim=1'),
    ('pipeline_costs', 'trainer', _new(_PIPE + 'costs: [1, 2]'),
     'p.costs has 2 entries but there are 5 layers'),
    ('pipeline_key_under_none', 'trainer', _new(_PIPE + 'costs.foo: 1'),
     'not Params'),
    # ---- Values and parser bounds.
    ('negative_learning_rate', 'trainer',
     _new('--model_params_override=task.train.learning_rate: -0.1'),
     'learning_rate must be finite and > 0, got -0.1'),
    ('infinite_learning_rate', 'trainer',
     _new('--model_params_override=task.train.learning_rate: inf'),
     'learning_rate must be finite and > 0, got inf'),
    ('none_for_a_float', 'trainer',
     _new('--model_params_override=task.train.learning_rate: None'),
     'None cannot replace its float value'),
    ('max_steps_beyond_int64', 'trainer',
     _new('--max_steps=9223372036854775808'), 'must be in [1, 2**63 - 1]'),
    ('index_of_5000_digits', 'trainer',
     _new(_PIPE + 'layers[' + '9' * 5000 + '].name: x'), 'at most 9 digits'),
    ('huge_literal', 'trainer',
     _new('--model_params_override=task.train.max_steps: 1' + '0' * 400),
     'more than 308 digits'),
    ('huge_list_header', 'trainer',
     _new(_PIPE + 'layers: list(len=99999999)'), 'exceed the 100,000'),
    ('type_outside_the_package', 'trainer',
     _new(_PIPE + 'layers[0].cls: type/lp_no_such_module.Layer'),
     'never imports other modules'),
    ('override_file_not_utf8', 'trainer',
     _new('--model_params_file_override={bad_utf8}'), 'is not UTF-8 text'),
    ('logdir_on_proc', 'trainer',
     [f'--model={br.MODEL}', '--logdir=/proc/lingvo_pipe_bad_input'],
     ('Cannot write to --logdir', 'is not writable')),
    ('logdir_name_too_long', 'trainer',
     [f'--model={br.MODEL}', '--logdir={fresh}/' + 'a' * 300],
     'more than the 255'),
    # ---- Damaged logdirs (copies of a trained one).
    ('garbage_state_file', 'trainer', _train('garbage_state'),
     'is not a checkpoint state file'),
    ('truncated_checkpoint', 'trainer', _train('truncated'),
     'ckpt-30 cannot be read'),
    ('bit_flipped_checkpoint', 'trainer', _train('bit_flipped'),
     'ckpt-30 cannot be read'),
    ('zeroed_checkpoint_index', 'trainer', _train('zeroed_index'),
     'ckpt-30 cannot be read'),
    ('params_txt_not_utf8', 'trainer', _train('params_not_utf8'),
     'is not UTF-8 text'),
    # ---- The evaler.
    ('eval_unknown_model', 'evaler', ['--logdir={typo}'],
     f'Closest: {br.MODEL}'),
    ('eval_malformed_override', 'evaler',
     ['--logdir={eval}', '--model_params_override=input.batch_size = 3'],
     'Malformed params line'),
    ('eval_undefined_param', 'evaler',
     ['--logdir={eval}', '--model_params_override=input.batch_sise: 3'],
     "Did you mean 'batch_size'"),
    ('eval_bad_enum', 'evaler', ['--logdir={eval}', '--mode=once'],
     'value should be one of <latest|all|continuous>'),
    ('eval_not_a_logdir', 'evaler', ['--logdir={fresh}'],
     'run the trainer first'),
    ('eval_one_checkpoint_continuously', 'evaler',
     ['--logdir={eval}', '--checkpoint=10', '--mode=continuous'],
     '--checkpoint=10 scores one checkpoint, --mode=continuous waits'),
    ('eval_logdir_not_writable', 'evaler', ['--logdir={file}/logdir'],
     'is not writable'),
    ('eval_no_data', 'evaler',
     ['--logdir={eval}',
      '--model_params_override=input.npz_path: /no/such/data.npz'],
     'data not available'),
    ('eval_garbage_state_file', 'evaler', ['--logdir={garbage_state}'],
     'is not a checkpoint state file'),
    ('eval_truncated_checkpoint', 'evaler', ['--logdir={truncated}'],
     'ckpt-30 cannot be read'),
    ('eval_bit_flipped_checkpoint', 'evaler', ['--logdir={bit_flipped}'],
     'ckpt-30 cannot be read'),
    ('eval_params_txt_not_utf8', 'evaler', ['--logdir={params_not_utf8}'],
     'is not UTF-8 text'),
    ('eval_type_outside_the_package', 'evaler', ['--logdir={foreign_type}'],
     'never imports other modules'),
    # ---- Issue 29: typed params from text (a None default said nothing of
    # the type, so 'abc' reached int()), positional arguments (absl's
    # 92-line flag list, exit 1), checkpoints of other shapes (45 lines of
    # TensorFlow's restore error), a logdir with nothing to score.
    ('random_seed_not_an_int', 'trainer',
     _new('--model_params_override=task.random_seed: abc'),
     "task.random_seed : 'abc' as an int"),
    ('random_seed_not_an_int_in_a_file', 'trainer',
     _new('--model_params_file_override={bad_seed}'),
     "task.random_seed : 'abc' as an int"),
    ('layer_random_seed_a_float', 'trainer',
     _new(_PIPE + 'layers[0].random_seed: 1.5'),
     "is a float, but it holds an int or None"),
    ('fprop_dtype_not_a_dtype', 'trainer', _new(_PIPE + 'fprop_dtype: abc'),
     "task.pipeline.fprop_dtype : 'abc' as a DType"),
    ('micro_batch_size_not_an_int', 'trainer',
     _new(_PIPE + 'micro_batch_size: abc'),
     "task.pipeline.micro_batch_size : 'abc' as an int"),
    ('costs_not_numbers', 'trainer',
     _new(_PIPE + "costs: ['1', 'x', '3', '4', '5']"),
     'give one finite cost ≥ 0 per layer'),
    ('eval_random_seed_not_an_int', 'evaler',
     ['--logdir={eval}', '--model_params_override=task.random_seed: abc'],
     "task.random_seed : 'abc' as an int"),
    ('extra_positional_argument', 'trainer', _new('extra'),
     "unexpected argument 'extra'"),
    ('override_value_not_quoted', 'trainer',
     _new('--model_params_override=task.train.learning_rate:', '0.1'),
     "unexpected argument '0.1'"),
    ('worker_extra_positional_argument', 'worker', _new('extra'),
     "unexpected argument 'extra'"),
    ('eval_extra_positional_argument', 'evaler', ['--logdir={eval}', 'extra'],
     "unexpected argument 'extra'"),
    ('eval_checkpoint_of_other_shapes', 'evaler',
     ['--logdir={intact}', f'--model_params_override={_RESIZED}'],
     'ckpt-30 does not fit the model: regression.pipeline.out/b has shape '
     '[4] in the checkpoint but [5] in the model'),
    ('resume_checkpoint_of_other_shapes', 'trainer',
     _resume('no_params_txt', _RESIZED),
     'ckpt-30 does not fit the model: regression.pipeline.out/b has shape '
     '[4] in the checkpoint but [5] in the model'),
    ('resume_with_another_optimizer', 'trainer',
     _resume('no_params_txt', 'task.train.optimizer: sgd'),
     'momentum is not in it'),
    ('eval_no_checkpoint_yet', 'evaler', ['--logdir={eval}'],
     'holds no checkpoint yet'),
    # Found by probing (was a 170-line params diff; exit 0 with nothing
    # scored after 'Skipping ckpt-90: deleted before it could be read').
    ('resume_another_model', 'trainer',
     ['--logdir={intact}', '--model=image.fashion_mnist.AmoebaNetGPipe'],
     f'is a run of {br.MODEL}, not image.fashion_mnist.AmoebaNetGPipe'),
    ('eval_dangling_state_file', 'evaler', ['--logdir={dangling_state}'],
     'ckpt-90 is the newest checkpoint listed'),
]


# One case of each binary, and two that read a checkpoint, run as real
# subprocesses: what forking after the imports does not cover is start-up.
_SUBPROCESS = ('unknown_model', 'worker_extra_positional_argument',
               'eval_truncated_checkpoint', 'resume_checkpoint_of_other_shapes')
assert set(_SUBPROCESS) <= {c[0] for c in _CASES}, _SUBPROCESS


def _flip(data, at):
  data = bytearray(data)
  data[int(len(data) * at)] ^= 0x10
  return bytes(data)


_DATA, _INDEX = 'ckpt-30.data-00000-of-00001', 'ckpt-30.index'
# Copies of the trained logdir: (file, how it is damaged).
_DAMAGE = {
    'garbage_state': ('checkpoint', lambda b: b'garbage \x00\xff\n'),
    'truncated': (_DATA, lambda b: b[:len(b) // 2]),
    # Near the end: the model's weights (sorted after the optimizer slots,
    # which the evaler does not read).
    'bit_flipped': (_DATA, lambda b: _flip(b, 0.95)),
    'zeroed_index': (_INDEX, lambda b: bytes(len(b))),
    'params_not_utf8': ('params.txt', lambda b: b.replace(b'\n', b'\xff\n',
                                                          1)),
    'foreign_type': ('params.txt', lambda b: b + (
        b'task.pipeline.layers[0].cls : type/lp_no_such_module.Layer\n')),
    'dangling_state': ('checkpoint', lambda b: b.replace(b'ckpt-30',
                                                         b'ckpt-90')),
    'intact': ('params.txt', lambda b: b),
    'no_params_txt': ('params.txt', lambda b: None),  # None: deleted.
}


@pytest.fixture(scope='module')
def bad_runs(tmp_path_factory, trained_logdir):
  tmp = tmp_path_factory.mktemp('bad')
  file = tmp / 'a_file'
  file.write_text('not a directory')
  bad_utf8 = tmp / 'bad_utf8.txt'
  bad_utf8.write_bytes(b'task.name : caf\xe9\n')
  bad_seed = tmp / 'bad_seed.txt'
  bad_seed.write_text('task.train.learning_rate : 0.02\n'
                      'task.random_seed : abc\n')
  dirs = {}
  for name, model in (('eval', br.MODEL), ('typo', _TYPO)):
    dirs[name] = tmp / name
    dirs[name].mkdir()
    text = model_registry.get_params(br.MODEL, 'Train').ToText()
    (dirs[name] / 'params.txt').write_text(
        text.replace(f"model : '{br.MODEL}'", f"model : '{model}'"))
  for name, (target, damage) in _DAMAGE.items():
    dirs[name] = tmp / name
    shutil.copytree(trained_logdir, dirs[name])
    path = dirs[name] / target
    damaged = damage(path.read_bytes())
    if damaged is None:
      path.unlink()
    else:
      path.write_bytes(damaged)
  before = {name: br.tree(d) for name, d in dirs.items()}
  runs = []
  for case, binary, args, _ in _CASES:
    fields = dict(fresh=tmp / case, file=file, bad_utf8=bad_utf8,
                  bad_seed=bad_seed, **dirs)
    runs.append((binary, [a.format(**fields) for a in args]))
  # These run as a user runs them, as subprocesses; the others in children
  # forked after the imports (br.run_many_forked: ~5 CPU-seconds less each).
  real = [i for i, c in enumerate(_CASES) if c[0] in _SUBPROCESS]
  forked = [i for i in range(len(_CASES)) if i not in real]
  # A hang guard only, on a machine that may be busy.
  done = dict(zip(real, br.run_many([runs[i] for i in real], parallel=2,
                                    timeout=60 * len(real))))
  # The subprocess cases forked too, last, for
  # test_forked_runs_are_what_a_user_sees.
  both = br.run_many_forked([runs[i] for i in forked + real],
                            timeout=10 * len(runs))
  done.update(zip(forked, both))
  results = {c[0]: done[i] for i, c in enumerate(_CASES)}
  results['forked'] = {_CASES[i][0]: result
                       for i, result in zip(real, both[len(forked):])}
  return results, tmp, dirs, before


def test_the_table_covers_pipeline_params_and_every_kind_of_damage():
  assert len(_CASES) >= 35
  assert sum(c[0].startswith('pipeline_') for c in _CASES) >= 10


def test_forked_runs_are_what_a_user_sees(bad_runs):
  results = bad_runs[0]
  for case, forked in results['forked'].items():
    assert forked == results[case], case


@pytest.mark.parametrize('case, binary, expected',
                         [(c[0], c[1], c[3]) for c in _CASES],
                         ids=[c[0] for c in _CASES])
def test_one_line_exit_2_nothing_written(bad_runs, case, binary, expected):
  results, tmp, dirs, before = bad_runs
  rc, out, err = results[case]
  lines = err.strip().splitlines()
  assert rc == 2, err
  assert len(lines) == 1, err
  assert lines[0].startswith(f'{binary}: error: ')
  alternatives = expected if isinstance(expected, tuple) else (expected,)
  assert any(e in lines[0] for e in alternatives), lines[0]
  assert not out
  assert not (tmp / case).exists()
  assert not os.path.exists('/proc/lingvo_pipe_bad_input')
  # Byte for byte: every file's content hash and mtime are unchanged.
  assert {name: br.tree(d) for name, d in dirs.items()} == before
